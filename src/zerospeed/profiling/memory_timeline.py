"""A memory timeline of one training step, per rank: by phase and by owner, accounted against measured.

*Measured* is what the process really used: on CUDA the caching allocator (``memory_allocated`` and its
peak), on the host the resident set (RSS, and the kernel's high-water mark, reset at every phase change
through ``/proc/self/clear_refs``). *Accounted* is the sum of the tensor storages we can name, each counted
once (by storage, so views and flat buffers are never counted twice):

* the library's own buffers, read from the engine whenever one of its methods returns: ``parameters`` (what
  a rank keeps: full parameters at stages 0-2, shards at stage 3), ``gathered_params`` (stage-3 full values),
  ``master`` (fp32 master partitions), ``optimizer_state``, ``grad_buckets`` (full-size or transient bucket
  buffers of the gradient reducer, collectives' send/receive buffers), ``grad_partitions`` (this rank's
  reduced fp32 gradient partition), ``param_grads`` (``p.grad`` before the reducer takes it), ``buffers``;
* every tensor an operator allocates during the step (a ``TorchDispatchMode`` sees each op's outputs, a weak
  reference says when the storage dies), owned by the library context it was made in (gathering: gathered
  parameters; the reducer: buckets; the optimizer step: its temporaries) or, outside one, by
  ``activations`` once autograd saves it for backward (saved-tensor hooks) and ``temporaries`` otherwise
  (activation gradients, intermediate results).

On the host, ``heap_free`` is what glibc's heap holds free (``mallinfo2``, measured by the allocator, above
its value at the start): freed tensors' memory the allocator keeps and that the RSS still counts.
``op_scratch`` is memory an operator used *inside* itself and gave back before it returned (a kernel's
workspace): the op tracker sees outputs, not that, so around every operator the timeline reads the measured
counter (host: RSS and its high-water mark, reset before the op; CUDA: the allocator's) and takes ``peak
during the op - measured after it`` as the op's scratch, named by op (``op_scratch_by_op``: the largest).
Both are *measured*, not accounted.

Two moments per phase: the *accounted peak* (most tensor bytes named: ``accounted_peak``, ``owners``,
``heap_free``) and the *measured peak* (the op during which the measured counter peaked: ``peak_accounted``,
``peak_owners``, ``peak_heap_free``, ``peak_op_scratch``, ``peak_op``). They differ: on a CPU backward the RSS
may peak on the last gradients while the tensors peaked at its start, the difference being freed activations
the allocator kept. ``other`` is measured minus what is named at the measured peak: memory nothing explains
(the Python heap, runtime memory, pages returned late). The baseline of the host measurement is the RSS at
the start of recording minus the bytes accounted at that moment (interpreter, libraries, data;
``malloc_trim`` is called first so freed heap the allocator kept does not hide in it); on CUDA it is
``memory_allocated`` minus the accounted bytes. "The timeline accounts for the peak" means: at the step's
measured peak (the highest phase peak, above the baseline), accounted + ``heap_free`` + ``op_scratch`` at that
moment is close to the measured bytes (``MemoryTimeline.coverage``).

Phases: ``forward``, ``backward``, ``reduce`` (the reducer's collectives inside backward and at the step),
``step`` (norm, clipping, the optimizer update), ``write_back`` (rebuilding parameters from the masters).
"""

from __future__ import annotations

import ctypes
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..accelerator.host_malloc import heap_free_bytes
from .memory import ProcMemory, _hwm_from_proc, _reset_hwm, rss_bytes

PHASES = ("forward", "backward", "reduce", "step", "write_back")
LIBRARY_OWNERS = ("master", "optimizer_state", "parameters", "gathered_params", "grad_buckets", "grad_partitions",
                  "param_grads", "buffers")
OWNERS = (*LIBRARY_OWNERS, "activations", "temporaries")


def malloc_trim() -> bool:
    """Give freed heap back to the OS (glibc); False where there is no glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _key(t: torch.Tensor) -> tuple[int, int] | None:
    """(storage identity, bytes) of a dense tensor; None for tensors without a plain storage."""
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return st._cdata, st.nbytes()


@dataclass
class PhaseRecord:
    """One phase's peaks. ``measured_peak``: above the baseline; ``owners``: accounted bytes at its accounted peak;
    ``peak_*``: what is named at its measured peak."""

    phase: str
    entries: int = 0
    measured_peak: int = 0
    accounted_peak: int = 0
    owners: dict[str, int] = field(default_factory=dict)
    heap_free: int = 0  # host: glibc's free heap bytes at the accounted peak, above the start's
    # at the measured peak (the op during which the measured counter peaked; zero when no op was read):
    peak_accounted: int = 0  # accounted tensor bytes
    peak_owners: dict[str, int] = field(default_factory=dict)
    peak_heap_free: int = 0  # glibc's free heap (host), above the start's
    peak_op_scratch: int = 0  # measured: memory that op used inside itself (its peak minus what it left)
    peak_op: str = ""


@dataclass
class Sample:
    """A point of the timeline (taken when the accounted total moved by more than the resolution)."""

    t: float
    phase: str
    measured: int  # above the baseline
    accounted: int
    owners: dict[str, int]


def _dead(timeline: weakref.ref[MemoryTimeline], key: int) -> None:
    tl = timeline()
    if tl is not None:
        tl._dead(key)


class _Tracker(TorchDispatchMode):
    """Records the storages operators allocate while active and the memory each op used inside itself."""

    def __init__(self, timeline: MemoryTimeline) -> None:
        super().__init__()
        self.tl = timeline

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.tl._op_begin()
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.tl._track(t)
        self.tl._op_end(str(func))
        return out


class MemoryTimeline:
    """Record one (or more) training steps of ``engine``: ``with timeline.record(): <forward, backward, step>``.

    Owner bytes come from the engine's own objects, so only zerospeed engines are supported; ``device``
    defaults to the engine's. ``resolution`` (bytes): a sample is stored when the accounted total moved by
    at least this much since the last one.
    """

    def __init__(self, engine: Any, resolution: int = 1 << 20) -> None:
        self.engine = engine
        self.device = torch.device(engine.device)
        self.on_cuda = self.device.type == "cuda"
        self.resolution = resolution
        self.phases: dict[str, PhaseRecord] = {p: PhaseRecord(p) for p in PHASES}
        self.samples: list[Sample] = []
        self.baseline = 0
        self._stack: list[str] = []
        self._context: list[str] = []
        self._tracked: dict[int, list[Any]] = {}  # storage id -> [bytes, owner, live tensor count]
        self._by_owner: dict[str, int] = dict.fromkeys(OWNERS, 0)
        self._library: dict[int, str] = {}  # storage id -> owner, from the last refresh
        self._library_bytes: dict[str, int] = dict.fromkeys(LIBRARY_OWNERS, 0)
        self._last_sample = -(1 << 62)
        self._t0 = 0.0
        self._restore: list[Callable[[], None]] = []
        self._heap_free0 = 0
        self._proc: ProcMemory | None = None  # host: per-op RSS reads, open while recording
        self.op_scratch_by_op: dict[str, int] = {}  # op name -> largest scratch seen (>= resolution)
        self._peak_seen: dict[str, int] = {}  # phase -> measured peak at its last snapshot

    # --- owners of the library's buffers -----------------------------------------------------------
    def _library_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        eng = self.engine
        opt = eng.optimizer
        zero3 = eng.zero3
        if opt is not None:
            for grp in opt.groups:
                if grp.master is not None and not grp.alias:
                    yield "master", grp.master
            for st in opt.optimizer.state.values():
                for v in st.values():
                    if torch.is_tensor(v):
                        yield "optimizer_state", v
        if zero3 is not None:
            for s in zero3.shards:
                if s.local is not None:
                    yield "parameters", s.local
                if s.persistent:
                    yield "parameters", s.param.data
                elif s._full is not None:
                    yield "gathered_params", s._full
                if s.secondary is not None:
                    yield "parameters", s.secondary
        for p in eng.module.parameters():
            yield "parameters", p.data  # stage 3: a gathered value was named above, a shard is empty
        if opt is not None:
            yield from opt.reducer.owned_tensors()
            for t in opt.grad_partitions():
                yield "grad_partitions", t
        for p in eng.module.parameters():
            if p.grad is not None:
                yield "param_grads", p.grad
        for b in eng.module.buffers():
            yield "buffers", b

    def _refresh(self) -> None:
        """Re-read the library's buffers; tracked storages they own move from the tracked set to them."""
        library: dict[int, str] = {}
        totals = dict.fromkeys(LIBRARY_OWNERS, 0)
        for owner, t in self._library_tensors():
            k = _key(t)
            if k is None or k[0] in library or k[1] == 0:
                continue
            if t.device.type != self.device.type:
                continue
            library[k[0]] = owner
            totals[owner] += k[1]
            entry = self._tracked.pop(k[0], None)
            if entry is not None:
                self._by_owner[entry[1]] -= entry[0]
        self._library, self._library_bytes = library, totals

    # --- tracked allocations -----------------------------------------------------------------------
    def _track(self, t: torch.Tensor) -> None:
        if t.device.type != self.device.type:
            return
        k = _key(t)
        if k is None or k[1] == 0 or k[0] in self._library:
            return
        entry = self._tracked.get(k[0])
        if entry is None:
            owner = self._context[-1] if self._context else "temporaries"
            entry = self._tracked[k[0]] = [k[1], owner, 0]
            self._by_owner[owner] += k[1]
        entry[2] += 1
        weakref.finalize(t, _dead, weakref.ref(self), k[0])  # a weak reference: tensors may outlive the timeline

    def _dead(self, key: int) -> None:
        entry = self._tracked.get(key)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] <= 0:
            del self._tracked[key]
            self._by_owner[entry[1]] -= entry[0]

    def _retag(self, t: torch.Tensor, owner: str, only_from: tuple[str, ...] = ("temporaries",)) -> None:
        k = _key(t)
        entry = None if k is None else self._tracked.get(k[0])
        if entry is not None and entry[1] in only_from:
            self._by_owner[entry[1]] -= entry[0]
            self._by_owner[owner] += entry[0]
            entry[1] = owner

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._retag(t, "activations")
        return t

    # --- measurement -------------------------------------------------------------------------------
    def _measured_now(self) -> int:
        return (int(torch.cuda.memory_allocated(self.device)) if self.on_cuda else rss_bytes()) - self.baseline

    def _measured_peak(self) -> int:
        if self.on_cuda:
            return int(torch.cuda.max_memory_allocated(self.device)) - self.baseline
        hwm = _hwm_from_proc()
        return (hwm if hwm is not None else rss_bytes()) - self.baseline

    def _reset_peak(self) -> None:
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_hwm()

    def _now_and_peak(self) -> tuple[int, int] | None:
        """(measured now, peak since the last reset), above the baseline; None when not readable cheaply."""
        if self.on_cuda:
            return (int(torch.cuda.memory_allocated(self.device)) - self.baseline,
                    int(torch.cuda.max_memory_allocated(self.device)) - self.baseline)
        pair = self._proc.rss_and_peak() if self._proc is not None else None
        return None if pair is None else (pair[0] - self.baseline, pair[1] - self.baseline)

    def _op_begin(self) -> None:
        """Fold the peak since the last reset into the phase and restart it, so the next op's peak is its own."""
        read = self._now_and_peak()
        if read is None:
            return
        if self._stack:
            rec = self.phases[self._stack[-1]]
            rec.measured_peak = max(rec.measured_peak, read[1])
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            assert self._proc is not None
            self._proc.reset_peak()

    def _op_end(self, op: str) -> None:
        """After an op: its scratch is how far the measured peak during it rose above what it left behind."""
        read = self._now_and_peak()
        scratch = 0
        if read is not None:
            now, peak = read
            if self._stack:
                rec = self.phases[self._stack[-1]]
                rec.measured_peak = max(rec.measured_peak, peak)
            scratch = max(0, peak - now)
            if scratch >= self.resolution and scratch > self.op_scratch_by_op.get(op, 0):
                self.op_scratch_by_op[op] = scratch
            if self._stack:
                self._at_peak(self.phases[self._stack[-1]], peak, scratch, op)
        self._changed()

    def _at_peak(self, rec: PhaseRecord, peak: int, scratch: int, op: str) -> None:
        """Name what is there when ``rec``'s measured peak rises by the resolution (so few snapshots are taken)."""
        seen = self._peak_seen.get(rec.phase)
        if seen is not None and peak < seen + self.resolution:
            return
        self._peak_seen[rec.phase] = peak
        owners = self.owners_now()
        rec.peak_accounted, rec.peak_owners = sum(owners.values()), owners
        rec.peak_op_scratch, rec.peak_op = scratch, op
        if not self.on_cuda:
            free = heap_free_bytes()
            rec.peak_heap_free = max(0, free - self._heap_free0) if free is not None else 0

    def owners_now(self) -> dict[str, int]:
        out = dict(self._library_bytes)
        for owner in ("activations", "temporaries"):
            out[owner] = 0
        for owner, n in self._by_owner.items():
            out[owner] = out.get(owner, 0) + n
        return out

    def _changed(self) -> None:
        owners = self.owners_now()
        total = sum(owners.values())
        rec = self.phases[self._phase]
        if total > rec.accounted_peak:
            rec.accounted_peak, rec.owners = total, owners
            if not self.on_cuda:
                free = heap_free_bytes()
                rec.heap_free = max(0, free - self._heap_free0) if free is not None else 0
        if abs(total - self._last_sample) >= self.resolution:
            self._last_sample = total
            self.samples.append(Sample(time.perf_counter() - self._t0, self._phase, self._measured_now(), total,
                                       owners))

    @property
    def _phase(self) -> str:
        return self._stack[-1] if self._stack else "step"

    def _enter(self, phase: str) -> None:
        self._close_phase()
        self._stack.append(phase)
        self.phases[phase].entries += 1
        self._changed()

    def _exit(self) -> None:
        self._close_phase()
        self._stack.pop()

    def _close_phase(self) -> None:
        """Fold the measured peak since the last phase change into the current phase; restart the counter."""
        if self._stack:
            rec = self.phases[self._stack[-1]]
            rec.measured_peak = max(rec.measured_peak, self._measured_peak(), self._measured_now())
        self._reset_peak()

    # --- wiring ------------------------------------------------------------------------------------
    def enter(self, phase: str | None, owner: str) -> None:
        """A span of the reducer begins (``zero/reducer_events.py``): its phase, and who owns what it makes."""
        if phase is not None:
            self._enter(phase)
        self._context.append(owner)

    def leave(self, phase: str | None, owner: str) -> None:
        self._context.pop()
        self._refresh()
        self._changed()
        if phase is not None:
            self._exit()

    def _wrap(self, obj: Any, name: str, phase: str | None = None, context: str | None = None) -> None:
        if obj is None or not hasattr(obj, name):
            return
        original = getattr(obj, name)
        had_own = name in vars(obj)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if phase is not None:
                self._enter(phase)
            if context is not None:
                self._context.append(context)
            try:
                return original(*args, **kwargs)
            finally:
                if context is not None:
                    self._context.pop()
                self._refresh()
                self._changed()
                if phase is not None:
                    self._exit()

        setattr(obj, name, wrapped)
        self._restore.append(lambda: setattr(obj, name, original) if had_own else delattr(obj, name))

    def _install(self) -> None:
        eng, opt = self.engine, self.engine.optimizer
        self._wrap(eng, "forward", phase="forward")
        self._wrap(eng, "backward", phase="backward")
        self._wrap(eng, "step", phase="step")
        if opt is not None:
            red = opt.reducer
            self._restore.append(red.events.subscribe(self))  # the reducer's phase events: enter / leave
            self._wrap(opt, "_collect_grads", context="grad_partitions")
            self._wrap(opt, "_write_back", phase="write_back", context="temporaries")
            self._wrap(opt.optimizer, "step", context="optimizer_state")
        trimmer = eng.heap_trimmer
        if trimmer is not None and not self.on_cuda:  # trimmed free heap is not resident: count from after it
            original = trimmer.trim

            def trim() -> None:
                original()
                self._heap_free0 = heap_free_bytes() or 0

            trimmer.trim = trim
            self._restore.append(lambda: delattr(trimmer, "trim"))
        zero3 = eng.zero3
        if zero3 is not None:
            for name in ("acquire", "release", "end_forward", "end_backward"):
                self._wrap(zero3.fetcher, name, context="gathered_params")

    @contextmanager
    def record(self) -> Iterator[MemoryTimeline]:
        """Record the steps run inside the block (the engine's methods are wrapped only while it lasts)."""
        if not self.on_cuda:
            malloc_trim()
            self._heap_free0 = heap_free_bytes() or 0
            self._proc = ProcMemory()
        self._refresh()
        self.baseline = 0
        start = self._measured_now()
        self.baseline = start - sum(self.owners_now().values())
        self._t0 = time.perf_counter()
        self._install()
        self._reset_peak()
        tracker = _Tracker(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t), tracker:
                yield self
        finally:
            self._close_phase()
            if self._proc is not None:
                self._proc.close()
                self._proc = None
            for undo in reversed(self._restore):
                undo()
            self._restore.clear()

    # --- results -----------------------------------------------------------------------------------
    def peak_phase(self) -> PhaseRecord:
        """The phase with the highest measured peak."""
        return max(self.phases.values(), key=lambda r: r.measured_peak)

    @staticmethod
    def _named(rec: PhaseRecord) -> tuple[int, int, int, dict[str, int]]:
        """(accounted, heap_free, op_scratch, owners) at ``rec``'s measured peak; the accounted peak's where no
        op was read around (no ``/proc``)."""
        if rec.peak_op:
            return rec.peak_accounted, rec.peak_heap_free, rec.peak_op_scratch, rec.peak_owners
        return rec.accounted_peak, rec.heap_free, 0, rec.owners

    def coverage(self) -> float:
        """What is named at the step's measured peak (accounted tensors, the host heap's free bytes, the running
        op's scratch; the last two measured) over the measured peak (1.0: every byte above the baseline named)."""
        rec = self.peak_phase()
        acc, free, scratch, _ = self._named(rec)
        return (acc + free + scratch) / rec.measured_peak if rec.measured_peak > 0 else float("nan")

    def tensor_coverage(self) -> float:
        """Accounted tensor bytes alone at the step's measured peak over it."""
        rec = self.peak_phase()
        return self._named(rec)[0] / rec.measured_peak if rec.measured_peak > 0 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        rec = self.peak_phase()
        acc, free, scratch, _ = self._named(rec)
        return {
            "device": str(self.device), "baseline_bytes": self.baseline,
            "source": "cuda allocator" if self.on_cuda else "process RSS",
            "peak_phase": rec.phase, "measured_peak_bytes": rec.measured_peak, "peak_op": rec.peak_op,
            "accounted_at_peak_bytes": acc, "heap_free_bytes": free, "op_scratch_bytes": scratch,
            "accounted_peak_bytes": rec.accounted_peak,
            "op_scratch_by_op": dict(sorted(self.op_scratch_by_op.items(), key=lambda kv: -kv[1])[:10]),
            "coverage": self.coverage(), "tensor_coverage": self.tensor_coverage(),
            "phases": [vars(r) for r in self.phases.values() if r.entries],
            "samples": [vars(s) for s in self.samples],
        }

    def format_table(self, unit: int = 1 << 20) -> str:
        """One row per phase (MiB): the measured peak; at it, the accounted bytes by owner, the free heap, the
        running op's scratch and what nothing explains; last, the phase's accounted peak (another moment)."""
        rows = [r for r in self.phases.values() if r.entries]
        named = {r.phase: self._named(r) for r in rows}
        owners = [o for o in OWNERS if any(named[r.phase][3].get(o, 0) for r in rows)]
        heap = [] if self.on_cuda else ["heap_free"]
        cols = ["phase", "measured", "accounted", *owners, *heap, "op_scratch", "other", "max accounted"]
        body = []
        for r in rows:
            acc, free, scratch, own = named[r.phase]
            body.append([r.phase, f"{r.measured_peak / unit:.1f}", f"{acc / unit:.1f}",
                         *(f"{own.get(o, 0) / unit:.1f}" for o in owners),
                         *([] if self.on_cuda else [f"{free / unit:.1f}"]), f"{scratch / unit:.1f}",
                         f"{(r.measured_peak - acc - free - scratch) / unit:.1f}", f"{r.accounted_peak / unit:.1f}"])
        widths = [max(len(x) for x in col) for col in zip(cols, *body)]
        line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
        sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
        src = "CUDA allocator" if self.on_cuda else "RSS"
        peak = self.peak_phase()
        head = (f"memory per phase on {self.device} (MiB above the baseline of {self.baseline / unit:.0f} MiB; "
                f"measured: {src} peak; named at the peak: {self.coverage():.1%} of measured "
                f"in {peak.phase}" + ("" if self.on_cuda else f", tensors alone {self.tensor_coverage():.1%}")
                + (f"; the peak was inside {peak.peak_op}" if peak.peak_op else "") + ")")
        ops = [f"{r.phase}: {r.peak_op}" for r in rows if r.peak_op_scratch >= self.resolution]
        tail = ["op scratch at the peak (measured inside the op): " + "; ".join(ops)] if ops else []
        return "\n".join([head, line(cols), sep, *(line(b) for b in body), *tail])
