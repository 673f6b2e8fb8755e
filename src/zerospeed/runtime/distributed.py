"""``zerospeed.init_distributed``: DeepSpeed's signature over ``comm.init_distributed``.

Ranks learn their place from torchrun's variables (``zerospeed launch`` sets them). Without them a script
runs as a world of one. MPI launchers (mpirun's ``OMPI_*`` / ``PMI_*`` variables) are not supported yet
and say so instead of silently starting N worlds of one.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from .. import comm
from ..config import load_config
from ..config.errors import NotSupportedYetError

_MPI_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: timedelta | float | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Join the job: gloo on CPU, nccl on CUDA; a no-op when already joined or ``dist_init_required=False``."""
    if dist_init_required is False or comm.is_initialized():
        return
    from_env = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not from_env and any(v in os.environ for v in _MPI_VARS):
        raise NotSupportedYetError("init_distributed(auto_mpi_discovery)", "this process was started by an MPI "
                                   "launcher; zerospeed does not read MPI ranks yet. Launch with `zerospeed launch` "
                                   "(torchrun) instead.")
    if not from_env and rank >= 0 and world_size > 0:
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    comm.init_distributed(dist_backend, timeout=timeout, init_method=init_method)
    if config is not None:
        section = load_config(config).comms_logger
        comm.COMMS_LOGGER.configure(section.enabled, section.verbose, section.prof_all, section.prof_ops,
                                    section.debug)
    if verbose and comm.get_rank() == 0 and comm.get_world_size() > 1:
        print(f"[zerospeed] joined: backend {comm.backend_name()}, world size {comm.get_world_size()}", flush=True)
