"""``engine.no_sync()``: backward passes inside accumulate gradients locally, without communicating.

Allowed at ZeRO stages 0 and 1, whose reducer keeps a full-size gradient buffer: inside the block every
backward adds into it and nothing is reduced; the next backward outside the block on an accumulation
boundary reduces everything accumulated (its sum over the ranks, then the usual average). Stages 2 and 3
keep only their partition of each gradient, so they cannot defer the reduction; the block refuses them, as
DeepSpeed does. ``engine.step()`` inside the block is refused too (DeepSpeed's rule: it would apply
gradients that no rank has reduced), and so is a block inside a block.

DeepSpeed asserts in all three places, so the error is a ``NoSyncError``: both a ``RuntimeError`` and an
``AssertionError``, with DeepSpeed's wording first; code written for either catches it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class NoSyncError(RuntimeError, AssertionError):
    """A misuse of ``engine.no_sync()`` (see the module docstring)."""


@contextmanager
def no_sync_block(engine: Any) -> Iterator[None]:
    """The block ``engine.no_sync()`` returns; ``engine._inside_no_sync`` is what the backward reads."""
    if engine.zero_optimization_stage() >= 2:  # the engine's accessor, as the block read it in engine.py
        raise NoSyncError(f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage "
                          f"{engine.zero_optimization_stage()}: stages 2 and 3 partition gradients as they are produced, so they cannot "
                          "defer the reduction. Use gradient_accumulation_steps instead")
    if engine._inside_no_sync:
        raise NoSyncError("no_sync context manager reentry is unsupported: engine.no_sync() is already open")
    engine._inside_no_sync = True
    try:
        yield
    finally:
        engine._inside_no_sync = False


def check_step(engine: Any) -> None:
    """Before ``engine.step()``: refused inside the block."""
    if engine._inside_no_sync:
        raise NoSyncError("It is illegal to call Engine.step() inside no_sync context manager: it would apply "
                          "gradients that were never reduced. Leave the no_sync() block for the last backward "
                          "before step()")
