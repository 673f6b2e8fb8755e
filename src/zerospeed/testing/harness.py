"""Run a function on N Gloo ranks in forked processes: warm imports, one deadline, every traceback.

Forking from a parent that already imported torch costs ~0.1 s per rank instead of ~5 s for a
fresh interpreter. The parent watches each rank from its own thread against one shared deadline;
on the first failure or at the deadline every remaining rank is killed, and the error shows each
failing rank's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from .. import comm


class DistributedTestError(AssertionError):
    """One or more ranks failed or missed the deadline."""


_WARMED = False


def _warm_up() -> None:
    """Import in the parent what every rank would otherwise import after the fork (once per process).

    The first torch optimizer step imports ``torch._dynamo`` (~5 s); paid here once, not per rank.
    """
    global _WARMED
    if _WARMED:
        return
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    torch.optim.AdamW([p]).step()
    import zerospeed.runtime  # noqa: F401

    _WARMED = True


def _child(rank: int, world: int, store_path: str, fn: Callable[..., Any], args: tuple, kwargs: dict,
           conn: Any, timeout: float, backend: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler (a test session's teardown hook)
    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"})
    try:
        if backend == "gloo":  # CPU ranks even on a machine with a GPU
            from ..accelerator import CpuAccelerator, set_accelerator

            set_accelerator(CpuAccelerator())
        comm.init_distributed(dist_backend=backend, store=comm.file_store(store_path, world), rank=rank,
                              world_size=world, timeout=timeout)
        # Every rank finishes connecting before any can run (and exit): a rank that fails fast would
        # otherwise close its sockets while a slow peer is still in Gloo's connectFullMesh.
        comm.barrier()
        result = fn(*args, **kwargs)
        # Plain pickle: tensors travel by value (torch's shared-memory reducers would not outlive the rank).
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        try:
            conn.send_bytes(pickle.dumps(("err", traceback.format_exc())))
        except Exception:
            pass
    finally:
        try:
            comm.destroy()
        except Exception:
            pass
        conn.close()


def start_method(backend: str) -> str:
    """How ranks start: forked (warm imports, ~0.1 s a rank) on Gloo; spawned on NCCL (CUDA in the parent)."""
    return "spawn" if backend == "nccl" else "fork"


def run_distributed(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 60.0,
                    collective_timeout: float | None = None, backend: str = "gloo", fresh: bool = False,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result (picklable).

    ``timeout`` bounds the whole run; ``collective_timeout`` (default: ``timeout``) each collective.
    ``backend``: "gloo" (CPU, the default: forked ranks) or "nccl" (one CUDA device per rank: spawned ranks,
    since CUDA cannot run in a child forked after the parent touched it, and a parent touches it as soon as it
    asks ``get_device_capability()``; ``fn`` and its arguments must then pickle: a module-level function).
    ``fresh``: spawned ranks on Gloo too (~2 s more a run), for a measurement that the parent's process state
    would disturb (a forked rank inherits its parent's heap, free chunks included).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn" if fresh else start_method(backend))
    if ctx.get_start_method() == "fork":
        _warm_up()
    tmp = tempfile.mkdtemp(prefix="zs-harness-")
    store_path = os.path.join(tmp, "store")
    procs, conns = [], []
    for rank in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        child_args = (rank, world_size, store_path, fn, args, kwargs, send, collective_timeout or timeout, backend)
        p = ctx.Process(target=_child, args=child_args, daemon=True)
        p.start()
        send.close()
        procs.append(p)
        conns.append(recv)
    deadline = time.monotonic() + timeout
    results: list[Any] = [None] * world_size
    errors: dict[int, str] = {}
    failed = threading.Event()

    def watch(rank: int) -> None:
        conn = conns[rank]
        grace_end: float | None = None
        while True:
            now = time.monotonic()
            if now >= deadline:
                errors.setdefault(rank, f"rank {rank}: no result within the {timeout:.0f} s deadline")
                failed.set()
                return
            if failed.is_set():
                # Another rank failed: give this one a short grace period to report its own error.
                grace_end = grace_end or now + 2.0
                if now >= grace_end:
                    errors.setdefault(rank, f"rank {rank}: stopped after another rank failed")
                    return
            try:
                if conn.poll(0.05):
                    status, payload = pickle.loads(conn.recv_bytes())
                    if status == "ok":
                        results[rank] = payload
                    else:
                        errors[rank] = payload
                        failed.set()
                    return
            except (EOFError, OSError):
                errors[rank] = f"rank {rank}: process exited (code {procs[rank].exitcode}) without a result"
                failed.set()
                return

    threads = [threading.Thread(target=watch, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=5)
    for c in conns:
        c.close()
    try:
        os.remove(store_path)
    except OSError:
        pass
    try:
        os.rmdir(tmp)
    except OSError:
        pass
    if errors:
        primary = {r: e for r, e in errors.items() if "stopped after another rank failed" not in e}
        shown = primary or errors
        body = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(shown.items()))
        raise DistributedTestError(f"{len(shown)} of {world_size} ranks failed:\n{body}")
    return results
