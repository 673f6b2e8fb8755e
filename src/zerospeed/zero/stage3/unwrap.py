"""``unwrap_model_for_generation(engine)``: a ZeRO-3 model gathered once and run without its hooks.

Generation runs many small forwards; under stage 3 each one would gather and release every module's
parameters. Inside this block every parameter is held whole (``GatheredParameters`` over the model) and the
stage-3 module hooks are taken off, so the forwards are plain PyTorch; at exit the hooks go back on and the
parameters return to their shards. The recorded module order (the prefetch trace) is kept: the hooks come
back on the same modules, so the next training step runs as before. Below stage 3 (or for a plain module)
there is nothing to gather or remove and the block yields the model unchanged. DeepSpeed's name and
contract (``deepspeed.runtime.zero.unwrap_model_for_generation``, as TRL uses it); every rank must enter
the block (the gather is a collective).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .gathered import GatheredParameters


@contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Yield ``model`` (an engine from ``initialize()``) with its parameters whole and no stage-3 hooks."""
    zero3 = getattr(model, "zero3", None)
    if zero3 is None:
        yield model
        return
    with GatheredParameters(list(model.module.parameters())):
        with zero3.hooks_removed():
            yield model


__all__ = ["unwrap_model_for_generation"]
