"""``deepspeed.comm`` functions under DeepSpeed's names and signatures, over zerospeed's own collectives.

Each is a thin call into ``backend``/``collectives``/``p2p``/``logger``: DeepSpeed's argument order
(``output, input, op, group, async_op``), DeepSpeed's defaults.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from .backend import Group, barrier, destroy, get_world_size, world_group
from .collectives import ReduceOp, all_gather, all_reduce, reduce_scatter
from .logger import COMMS_LOGGER
from .p2p import global_rank_of


def destroy_process_group(group: Group | None = None) -> None:
    """Tear down the default process group (DeepSpeed's name for ``destroy``)."""
    destroy()


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Group | None = None) -> None:
    """In-place all-reduce for inference (DeepSpeed's argument order; it has a shared-memory path on CPU,
    zerospeed uses its one all-reduce)."""
    all_reduce(tensor, group=group, op=op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Group | None = None,
                           async_op: bool = False) -> Any:
    """Every rank's ``input_tensor``, in rank order, into the flat ``output_tensor``."""
    return all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Group | None = None, async_op: bool = False) -> Any:
    """Rank r receives the reduction of chunk r of ``input_tensor`` (DeepSpeed's argument order)."""
    return reduce_scatter(output_tensor, input_tensor, group=group, op=op, async_op=async_op)


def get_world_group() -> Group:
    """The group of every rank."""
    return world_group()


def get_global_rank(group: Group | None = None, group_rank: int = 0) -> int:
    """The global rank of ``group_rank`` within ``group``."""
    return global_rank_of(group, group_rank)


def monitored_barrier(group: Group | None = None, timeout: timedelta | None = None, wait_all_ranks: bool = False,
                      prof: bool = False, log_name: str = "monitored_barrier") -> None:
    """A barrier that names the rank that did not arrive (zerospeed's ``barrier`` always does, bounded)."""
    barrier(group)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict | None:
    """Print the comms logger's table (rank 0's view); with ``return_dict``, also return the per-op stats."""
    print(COMMS_LOGGER.summary(get_world_size()), flush=True)
    return dict(COMMS_LOGGER.snapshot()) if return_dict else None


def configure(deepspeed_config: Any = None, enabled: bool | None = None, prof_all: bool | None = None,
              prof_ops: list[str] | None = None, verbose: bool | None = None, debug: bool | None = None) -> None:
    """Set the comms logger's switches; a ``deepspeed_config`` (its ``comms_logger`` section) is read first."""
    section = getattr(deepspeed_config, "comms_logger", None) if deepspeed_config is not None else None
    log = COMMS_LOGGER
    base = {"enabled": log.enabled, "verbose": log.verbose, "prof_all": log.prof_all, "prof_ops": log.prof_ops,
            "debug": log.debug}
    if section is not None:
        base.update({k: getattr(section, k) for k in base if hasattr(section, k)})
    given = {"enabled": enabled, "verbose": verbose, "prof_all": prof_all, "prof_ops": prof_ops, "debug": debug}
    base.update({k: v for k, v in given.items() if v is not None})
    log.configure(**base)


__all__ = ["all_gather_into_tensor", "configure", "destroy_process_group", "get_global_rank", "get_world_group",
           "log_summary", "monitored_barrier", "reduce_scatter_tensor"]
