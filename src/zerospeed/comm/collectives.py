"""The collectives zerospeed uses, each counted by the comms logger and failing with rank/op/group named."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from . import symmetric
from .backend import Group, device_for_backend, get_rank, get_world_size, is_initialized, note_failure
from .logger import loggers
from .recoverable import RecoverableGroup, resolve

# torch 2.13 names the tensor collectives ``reduce_scatter_single`` / ``all_gather_single``; 2.11-2.12 (the CUDA
# image of the device machine used by scripts/gpu-check) have the same calls as ``reduce_scatter_tensor`` /
# ``all_gather_into_tensor`` (same arguments). Only 2.13 is tested in CI. Looked up at each call, so that a
# counter wrapped around ``torch.distributed``'s function (bench_compile.py) sees the call.
def _reduce_scatter_single(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def _all_gather_single(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)

ReduceOp = dist.ReduceOp


class CollectiveError(RuntimeError):
    """A collective failed or timed out; says which rank, which op, which group."""


class Handle:
    """An in-flight collective. ``wait()`` completes it and books its latency."""

    def __init__(self, work: Any, op: str, group: Group | None, t0: float) -> None:
        self._work = work
        self._op = op
        self._group = group
        self._t0 = t0
        self.done = work is None
        self.released = False
        self._loggers = loggers()  # where its latency is booked: the loggers of the call that launched it

    def release(self) -> None:
        """Let go of the backend's work without waiting (its group is being dropped after a failure)."""
        if not self.done:
            self._work, self.released = None, True

    def wait(self) -> None:
        if self.released:
            raise CollectiveError(f"rank {get_rank()}: collective '{self._op}' on group {_group_name(self._group)} "
                                  "was abandoned: its group was dropped after a failed step")
        if self.done:
            return
        try:
            self._work.wait()
        except RuntimeError as exc:
            raise _error(self._op, self._group, exc) from exc
        self.done = True
        seconds = time.perf_counter() - self._t0
        for lg in self._loggers:
            lg.add_time(self._op, seconds)


def _group_name(group: Group | None) -> str:
    if group is None:
        return "WORLD"
    if isinstance(group, RecoverableGroup):
        return f"ranks {group.ranks}"
    try:
        ranks = dist.get_process_group_ranks(resolve(group))
    except Exception:  # pragma: no cover - defensive, only for the message
        return "?"
    return f"ranks {ranks}"


def _error(op: str, group: Group | None, exc: BaseException) -> CollectiveError:
    note_failure()
    text = str(exc)
    hint = ""
    if "timed out" in text.lower() or "timeout" in text.lower():
        peers = [r for r in (_ranks(group) or ()) if r != get_rank()]
        who = f"rank {peers[0]} (the only peer)" if len(peers) == 1 else "a peer rank"
        hint = (f" -- {who} did not join this collective within the timeout (config 'comms_timeout_s'): "
                "it is hung, dead, or running different code")
    elif "closed by peer" in text.lower() or "connection reset" in text.lower():
        hint = (" -- a peer rank closed its connections: it crashed, or it raised inside a training step and "
                "abandoned the step (the engine then rebuilds its group at the next forward/backward/step)")
    return CollectiveError(f"rank {get_rank()}: collective '{op}' on group {_group_name(group)} failed: {text}{hint}")


def _ranks(group: Group | None) -> tuple[int, ...] | None:
    """The global ranks of ``group`` (for the per-group byte counts), None when not known."""
    if isinstance(group, RecoverableGroup):
        return tuple(group.ranks)
    if not is_initialized():
        return None
    if group is None:
        return tuple(range(dist.get_world_size()))
    try:
        return tuple(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - accounting only
        return None


def _run(op: str, group: Group | None, nbytes: int, volume: int, async_op: bool, fn: Any) -> Handle | None:
    t0 = time.perf_counter()
    try:
        work = fn()
    except RuntimeError as exc:
        raise _error(op, group, exc) from exc
    seconds = 0.0 if async_op else time.perf_counter() - t0
    ranks = _ranks(group)
    for lg in loggers():
        lg.record(op, nbytes, volume, seconds, ranks=ranks)
    if not async_op:
        return None
    handle = Handle(work, op, group, t0)
    return group.track(handle) if isinstance(group, RecoverableGroup) and not handle.done else handle


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, group: Group | None = None, op: Any = ReduceOp.SUM, async_op: bool = False) -> Handle | None:
    """In-place all-reduce."""
    if get_world_size(group) == 1:
        return Handle(None, "all_reduce", group, 0.0) if async_op else None
    n = _nbytes(tensor)
    return _run("all_reduce", group, n, 2 * n, async_op, lambda: dist.all_reduce(tensor, op=op, group=resolve(group), async_op=async_op))


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group | None = None, op: Any = ReduceOp.SUM,
                   async_op: bool = False, scratch: bool = False) -> Handle | None:
    """``input`` holds world_size equal chunks, rank r receives the reduction of chunk r in ``output``.

    ``scratch``: the caller no longer needs ``input``, so Gloo may use it as working memory (no copy)."""
    if get_world_size(group) == 1:
        output.copy_(input)
        return Handle(None, "reduce_scatter", group, 0.0) if async_op else None
    n = _nbytes(input)
    return _run("reduce_scatter", group, n, n, async_op,
                lambda: reduce_scatter_work(output, input, group, op, async_op, scratch))


def all_gather(output: torch.Tensor | list[torch.Tensor], input: torch.Tensor, group: Group | None = None,
               async_op: bool = False) -> Handle | None:
    """``output`` receives every rank's ``input`` in rank order: one flat tensor, or a list of one tensor per
    rank (``torch.distributed.all_gather``'s and ``deepspeed.comm.all_gather``'s form; gathered through one
    flat buffer, then copied out, so it is complete when this returns)."""
    if isinstance(output, (list, tuple)):
        flat = torch.empty(len(output) * input.numel(), dtype=input.dtype, device=input.device)
        all_gather(flat, input.contiguous().reshape(-1), group=group)
        for piece, part in zip(output, flat.chunk(len(output))):
            piece.copy_(part.view_as(piece))
        return Handle(None, "all_gather", group, 0.0) if async_op else None
    if get_world_size(group) == 1:
        output.copy_(input)
        return Handle(None, "all_gather", group, 0.0) if async_op else None
    n = _nbytes(output)
    sym = symmetric.gather_for(group, input)
    if sym is not None:  # compile.symmetric_memory: peers' shards read from their workspaces (comm/symmetric.py)
        return _run("all_gather", group, n, n, async_op, lambda: sym.all_gather(output, input))
    return _run("all_gather", group, n, n, async_op, lambda: all_gather_work(output, input, group, async_op))


def gathers_in_place(tensor: torch.Tensor, group: Group | None = None) -> bool:
    """Whether ``all_gather_in_place`` serves this tensor's device and group (Gloo on host tensors)."""
    return get_world_size(group) > 1 and _by_root(tensor, group)


def all_gather_in_place(pieces: list[list[torch.Tensor]], group: Group | None = None,
                        async_op: bool = False) -> Handle | None:
    """``pieces[r]`` are views that rank r has filled; afterwards every rank holds every rank's values in them:
    an all-gather with no staging buffer, no packing and no unpacking (one ``broadcast`` per piece, async,
    waited together). Gloo on host tensors only (``gathers_in_place``); pieces have the same sizes on all ranks.
    Counted as one ``all_gather`` of all the pieces' bytes."""
    pg = resolve(group)
    n = sum(_nbytes(t) for row in pieces for t in row)

    def launch() -> _Works | None:
        works = _Works([dist.broadcast(t, src=_global(group, r), group=pg, async_op=True)
                        for r, row in enumerate(pieces) for t in row if t.numel()])
        return works if async_op else works.wait() and None

    return _run("all_gather", group, n, n, async_op, launch)


class _Works:
    """Per-rank point-to-root collectives completed as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        try:
            while self.works:
                self.works.pop(0).wait()
        except BaseException:
            self.works.clear()  # the rest would keep the connections open from the traceback
            raise
        return True


def _by_root(tensor: torch.Tensor, group: Group | None) -> bool:
    """Gloo on host tensors: its ``reduce_scatter`` and ``all_gather`` are 2-4x slower than one ``reduce`` or
    ``broadcast`` per rank moving the same bytes (measured: docs/benchmarks.md, "Gloo collectives")."""
    return tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(resolve(group)))


def _global(group: Group | None, r: int) -> int:
    return r if group is None else dist.get_global_rank(resolve(group), r)


def reduce_scatter_work(output: torch.Tensor, input: torch.Tensor, group: Group | None, op: Any, async_op: bool,
                        scratch: bool = False) -> Any:
    """The reduce-scatter itself (no accounting). On Gloo with a ``scratch`` input: one ``reduce`` per rank, each
    to its chunk's owner, in place (Gloo overwrites the chunks it sends); otherwise the backend's own."""
    pg = resolve(group)
    if not (scratch and input.is_contiguous() and output.is_contiguous() and _by_root(input, group)):
        return _reduce_scatter_single(output, input, op=op, group=pg, async_op=async_op)
    world, me = dist.get_world_size(pg), dist.get_rank(pg)
    rows = input.view(world, -1)
    output.view(-1).copy_(rows[me])  # my chunk is reduced in place in ``output``
    if world == 2 and op == ReduceOp.SUM:
        return _pair_exchange(output.view(-1), rows, me, group, pg, async_op)
    works = [dist.reduce(output.view(-1) if r == me else rows[r], dst=_global(group, r), op=op, group=pg,
                         async_op=True) for r in range(world)]
    done = _Works(works)
    return done if async_op else done.wait() and None


class _Exchange(_Works):
    """A pair's reduce-scatter in flight: when the peer's half has arrived it is added to this rank's own."""

    def __init__(self, works: list[Any], out: torch.Tensor, got: torch.Tensor) -> None:
        super().__init__(works)
        self.out, self.got = out, got

    def wait(self) -> bool:
        if self.works:
            super().wait()
            self.out.add_(self.got)
        return True


def _pair_exchange(out: torch.Tensor, rows: torch.Tensor, me: int, group: Group | None, pg: Any,
                   async_op: bool) -> Any:
    """Two ranks: each sends the peer its half and receives the peer's contribution to its own (into its own
    row of the scratch input, already copied to ``out``), then adds: half the CPU time of two ``reduce`` calls
    (Gloo's reduce runs its ring even for two ranks; docs/benchmarks.md, "Gloo collectives")."""
    peer = _global(group, 1 - me)
    works = [dist.isend(rows[1 - me], dst=peer, group=pg), dist.irecv(rows[me], src=peer, group=pg)]
    done = _Exchange(works, out, rows[me])
    return done if async_op else done.wait() and None


def all_gather_work(output: torch.Tensor, input: torch.Tensor, group: Group | None, async_op: bool) -> Any:
    """The all-gather itself (no accounting); on Gloo one ``broadcast`` per rank of its chunk."""
    pg = resolve(group)
    if not (output.is_contiguous() and _by_root(output, group)):
        return _all_gather_single(output, input, group=pg, async_op=async_op)
    world, me = dist.get_world_size(pg), dist.get_rank(pg)
    rows = output.view(world, -1)
    rows[me].copy_(input.reshape(-1))
    done = _Works([dist.broadcast(rows[r], src=_global(group, r), group=pg, async_op=True) for r in range(world)])
    return done if async_op else done.wait() and None


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Group | None = None,
                      async_op: bool = False) -> Handle | None:
    """Rank r sends input chunk j (dim 0, ``input_split_sizes[j]`` rows) to rank j and receives rank j's
    chunk r into output chunk j (``output_split_sizes[j]`` rows); splits may be uneven. None: equal splits."""
    if get_world_size(group) == 1:
        output.copy_(input)
        return Handle(None, "all_to_all_single", group, 0.0) if async_op else None
    n = _nbytes(input)
    return _run(
        "all_to_all_single", group, n, n, async_op,
        lambda: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=resolve(group),
                                       async_op=async_op),
    )


def all_gather_by_broadcast(output: torch.Tensor, input: torch.Tensor, group: Group | None = None) -> None:
    """What ``all_gather`` computes, as one broadcast per rank (DeepSpeed's ``allgather_partitions: false``)."""
    world = get_world_size(group)
    n = input.numel()
    me = dist.get_rank(resolve(group)) if world > 1 else 0
    for r in range(world):
        chunk = output[r * n:(r + 1) * n]
        if r == me:
            chunk.copy_(input)
        if world > 1:
            src = dist.get_global_rank(resolve(group), r) if group is not None else r
            broadcast(chunk, src=src, group=group)


def broadcast(tensor: torch.Tensor, src: int, group: Group | None = None, async_op: bool = False) -> Handle | None:
    """``src`` is a global rank."""
    if get_world_size(group) == 1:
        return None
    n = _nbytes(tensor)
    return _run("broadcast", group, n, n, async_op, lambda: dist.broadcast(tensor, src=src, group=resolve(group), async_op=async_op))


def all_gather_object(obj: Any, group: Group | None = None) -> list[Any]:
    """Small python objects (pickled; only for trusted in-job data)."""
    if not is_initialized() or get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * get_world_size(group)
    try:
        dist.all_gather_object(out, obj, group=resolve(group))
    except RuntimeError as exc:
        raise _error("all_gather_object", group, exc) from exc
    return out


def broadcast_object(obj: Any, src: int = 0, group: Group | None = None) -> Any:
    if not is_initialized() or get_world_size(group) == 1:
        return obj
    box = [obj]
    try:
        dist.broadcast_object_list(box, src=src, group=resolve(group))
    except RuntimeError as exc:
        raise _error("broadcast_object", group, exc) from exc
    return box[0]


def exchange_ints(values: list[int], group: Group | None = None) -> list[list[int]]:
    """Every rank's ``values`` (same length on all ranks), in rank order: one small all-gather.

    Counted by the comms logger as ``exchange_ints`` (control messages, apart from data all-gathers).
    """
    world = get_world_size(group)
    if world == 1:
        return [list(values)]
    device = device_for_backend(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    n = _nbytes(out)
    _run("exchange_ints", group, _nbytes(mine), n, False,
         lambda: _all_gather_single(out, mine, group=resolve(group)))
    return out.view(world, -1).tolist()


def all_reduce_max_flag(flag: bool, group: Group | None = None) -> bool:
    """True on every rank when ``flag`` is true on any rank.

    Counted by the comms logger as ``all_reduce_flag`` (control messages: overflow verdicts, commit points),
    apart from the data all-reduces.
    """
    if get_world_size(group) == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32, device=device_for_backend(group))
    all_reduce_flags(t, group)
    return bool(t.item() > 0)


def all_reduce_flags(flags: torch.Tensor, group: Group | None = None) -> None:
    """In-place MAX all-reduce of a small vector of flags, logged as ``all_reduce_flag`` (a control message)."""
    if get_world_size(group) == 1:
        return
    n = _nbytes(flags)
    _run("all_reduce_flag", group, n, 2 * n, False,
         lambda: dist.all_reduce(flags, op=ReduceOp.MAX, group=resolve(group)))
