"""Process-group lifecycle: the only place that creates or destroys groups."""

from __future__ import annotations

import atexit
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..accelerator import get_accelerator
from .recoverable import RecoverableGroup, resolve

Group = dist.ProcessGroup
DEFAULT_TIMEOUT = timedelta(minutes=30)


def _gloo_workers_busy() -> bool:
    """True while a Gloo worker thread of this process is running (Linux: read from /proc; else False)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        name, state = stat[stat.find("(") + 1: stat.rfind(")")], stat[stat.rfind(")") + 2: stat.rfind(")") + 3]
        if name.startswith("pt_gloo") and state not in ("S", "D", "I"):
            return True
    return False


class _AtExit:
    """At interpreter exit: let Gloo's worker threads settle, then destroy the group init_distributed made.

    A Gloo worker finishes each collective's bookkeeping just after the collective returns; when the
    script ends right then (its last step), the interpreter starts tearing down while the worker still
    runs, and the rank aborts with ``terminate called without an active exception`` (SIGABRT) after a
    run that succeeded. ``destroy_process_group`` alone does not stop the workers while any object (an
    engine) still refers to the group; so first wait, bounded, until every worker thread sleeps. The
    group is left alone once a collective failed in this process (a collective still pending would hold
    the exit for up to the collective timeout).
    """

    SETTLE_S = 2.0

    def __init__(self) -> None:
        self.registered = False
        self.failed = False

    def arm(self) -> None:
        if not self.registered:
            atexit.register(self)
            self.registered = True

    def __call__(self) -> None:
        deadline, calm = time.monotonic() + self.SETTLE_S, 0
        while calm < 2 and time.monotonic() < deadline:  # two quiet looks in a row
            calm = 0 if _gloo_workers_busy() else calm + 1
            time.sleep(0.001)
        if self.failed or not is_initialized():
            return
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - at exit, nothing can be done about it any more
            pass


_AT_EXIT = _AtExit()  # process-wide, as the default process group it cleans up


def note_failure() -> None:
    """A collective failed in this process: leave the process group alone at exit (see _AtExit)."""
    _AT_EXIT.failed = True


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(
    dist_backend: str | None = None,
    timeout: timedelta | float | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    store: Any = None,
) -> None:
    """Join the job (env:// from torchrun variables unless told otherwise). Gloo on CPU, NCCL on CUDA.

    A no-op when already initialized. Without torchrun variables and without arguments, starts a
    world of one on a loopback address so that single-process scripts work unchanged.
    """
    if is_initialized():
        return
    acc = get_accelerator()
    backend = dist_backend or acc.communication_backend
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=float(timeout))
    timeout = timeout or DEFAULT_TIMEOUT
    if store is None and init_method is None:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            os.environ.setdefault("LOCAL_RANK", "0")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        init_method = "env://"
    if rank is None and "RANK" in os.environ and store is None:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
    if acc.name == "cuda":
        acc.set_device(int(os.environ.get("LOCAL_RANK", rank or 0)))
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = init_method
    if rank is not None:
        kwargs["rank"] = rank
        kwargs["world_size"] = world_size
    dist.init_process_group(**kwargs)
    _AT_EXIT.arm()


def set_timeout(timeout: timedelta | float, group: Group | None = None) -> None:
    """Change how long collectives on ``group`` (default: the world) wait for peers before failing.

    For a job that is already initialized (by the user, the launcher or the test harness), so that the
    config's ``comms_timeout_s`` applies however the process group was created.
    """
    if not is_initialized():
        return
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=float(timeout))
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout  # no public equivalent in torch 2.13
    except ImportError:  # pragma: no cover - depends on the torch version
        import warnings

        warnings.warn("this torch cannot change the timeout of an existing process group: comms_timeout_s "
                      "applies only when zerospeed creates the group (init_distributed(timeout=...))")
        return
    _set_pg_timeout(timeout, resolve(group))


def default_store() -> Any | None:
    """The rendezvous store of the world process group (a key-value store every rank reaches over the network,
    not the file system), or None when there is none. Used for small out-of-band messages from background
    threads that must not issue collectives (an async checkpoint's failure)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private API: absent or changed means "no store"
        return None


def file_store(path: str, world_size: int) -> Any:
    """A rendezvous store on a shared file (used by the test harness)."""
    return dist.FileStore(path, world_size)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def destroy() -> None:
    if is_initialized():
        dist.destroy_process_group()


def world_group() -> Group:
    return dist.group.WORLD  # type: ignore[return-value]


def get_rank(group: Group | None = None) -> int:
    if isinstance(group, RecoverableGroup):  # answered without touching (or rebuilding) its connections
        return group.rank
    return dist.get_rank(resolve(group)) if is_initialized() else 0


def get_world_size(group: Group | None = None) -> int:
    if isinstance(group, RecoverableGroup):
        return group.size()
    return dist.get_world_size(resolve(group)) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node, as the launcher set it (``LOCAL_RANK``, or Open MPI's
    ``OMPI_COMM_WORLD_LOCAL_RANK``); 0 without a launcher. DeepSpeed's ``deepspeed.comm.get_local_rank()``."""
    value = os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={value!r} is not an integer") from None


def get_local_world_size() -> int:
    """Processes on this node (``LOCAL_WORLD_SIZE`` from torchrun); 1 without a launcher."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1")))


def new_group(ranks: list[int], timeout: timedelta | None = None) -> Group:
    """A subgroup; every rank of the world must call this with the same ranks."""
    return dist.new_group(ranks=ranks, timeout=timeout)


def barrier(group: Group | None = None) -> None:
    """Wait for every rank of ``group``; a timeout or dead peer raises naming rank and group."""
    if not is_initialized():
        return
    try:
        dist.barrier(group=resolve(group))
    except RuntimeError as exc:
        from .collectives import CollectiveError

        note_failure()
        where = "WORLD" if group is None else f"ranks {dist.get_process_group_ranks(resolve(group))}"
        raise CollectiveError(f"rank {get_rank()}: collective 'barrier' on group {where} failed: {exc}") from exc


def backend_name(group: Group | None = None) -> str:
    return str(dist.get_backend(resolve(group)))


def device_for_backend(group: Group | None = None) -> torch.device:
    """Tensors handed to collectives must live here (gloo: cpu; nccl: the current cuda device)."""
    if backend_name(group) == "nccl":
        return get_accelerator().device()
    return torch.device("cpu")
