"""A load is collective and atomic: stage everything, agree, then apply.

1. **Stage** (nothing in the engine changes): check what the checkpoint says against the engine (names,
   shapes, partitioning, counters, optimizer groups), parse this rank's RNG file, and read every tensor range
   this rank will need into memory (``StagedReader.stage``), so a missing key, an index range that does not
   cover the owned elements or a wrong-sized state vector fails here.
2. **Agree**: one all-reduce of a failure flag over the engine's group (``comm.all_reduce_max_flag``); only
   when some rank failed are the messages gathered, and every rank raises the same ``CheckpointError``
   naming the first failing rank. The engine is unchanged on every rank.
3. **Apply** from memory. What can still fail there (a read of a file the stage did not prefetch: module
   buffers, client tensors) is agreed on the same way, and reported as a load that may have been applied in
   part (the message says to build a new engine).
"""

from __future__ import annotations

from typing import Any

import torch

from ... import comm
from .errors import CheckpointError


class StagedReader:
    """A checkpoint reader (``CheckpointReader``, or the tensor-parallel ``TPReader`` around one) whose reads of
    staged ranges come from memory."""

    def __init__(self, inner: Any, ckpt: str) -> None:
        self.inner = inner
        self.ckpt = ckpt
        self._ranges: dict[tuple[str, int, int], torch.Tensor] = {}
        self._scalars: dict[str, torch.Tensor] = {}

    def stage(self, key: str, lo: int, hi: int) -> None:
        if (key, lo, hi) not in self._ranges:
            self._ranges[(key, lo, hi)] = self.inner.read_range(key, lo, hi)

    def stage_scalar(self, key: str) -> None:
        if not self.inner.has(key):
            raise CheckpointError(f"checkpoint {self.ckpt} has no tensor {key!r}")
        if key not in self._scalars:
            self._scalars[key] = self.inner.read_scalar(key)

    def check(self, key: str, lo: int, hi: int) -> None:
        """What :meth:`stage` checks, from the index alone (nothing read or kept)."""
        self.inner.covers(key, lo, hi)

    def check_scalar(self, key: str) -> None:
        if not self.inner.has(key):
            raise CheckpointError(f"checkpoint {self.ckpt} has no tensor {key!r}")

    def release(self) -> None:
        """Drop what was staged (the reader stays open)."""
        self._ranges.clear()
        self._scalars.clear()

    def has(self, key: str) -> bool:
        return self.inner.has(key)

    def dtype(self, key: str) -> torch.dtype:
        return self.inner.dtype(key)

    def read_range(self, key: str, lo: int, hi: int) -> torch.Tensor:
        staged = self._ranges.get((key, lo, hi))
        return staged.clone() if staged is not None else self.inner.read_range(key, lo, hi)

    def read_scalar(self, key: str) -> torch.Tensor:
        staged = self._scalars.get(key)
        return staged.clone() if staged is not None else self.inner.read_scalar(key)

    def close(self) -> None:
        self._ranges.clear()
        self._scalars.clear()
        self.inner.close()


def stage_tensors(reader: StagedReader, owned: list[Any], layout: dict[str, Any] | None, keep: bool = True) -> None:
    """Read every range ``load_params`` / ``load_optimizer_state`` will ask for (shapes were checked by
    ``module_state.check_names``); a key or element range the checkpoint does not hold fails here. ``keep``
    False: only check that the index holds them (``pipeline_loading_checkpoint`` reads them later, in turns)."""
    from .universal import master_read_range

    stage = reader.stage if keep else reader.check
    stage_scalar = reader.stage_scalar if keep else reader.check_scalar
    for op in owned:
        stage(f"master/{op.name}", *master_read_range(op))
        lay = None if layout is None else layout.get(op.name)
        if lay is None:
            continue
        for k in lay.get("elementwise", []):
            if op.hi > op.lo:
                stage(f"optim/{k}/{op.name}", op.lo, op.hi)
        for k in lay.get("scalar", []):
            stage_scalar(f"scalar/{k}/{op.name}")


def check_counters(counters: Any, where: str) -> None:
    if not isinstance(counters, dict):
        raise CheckpointError(f"{where}: field 'engine' is not a mapping of counters")
    for key in ("global_steps", "global_samples", "skipped_steps", "micro_steps"):
        v = counters.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CheckpointError(f"{where}: field 'engine.{key}' is {v!r}, not a non-negative integer")


def agree(error: str, group: Any, what: str, after: str) -> None:
    """Collective: one flag all-reduce; when any rank failed, every rank raises the first rank's error."""
    if not comm.all_reduce_max_flag(bool(error), group=group):
        return
    errors = comm.all_gather_object(error, group=group)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    rank, first = failed[0]
    more = f" (and on rank(s) {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
    raise CheckpointError(f"{what} failed on rank {rank}: {first}{more}{after}")
