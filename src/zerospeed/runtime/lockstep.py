"""Checks that the ranks of one engine run the same thing, made once where a mismatch would otherwise crash a
collective or train silently on half-synchronised weights.

``check_same_model``: at ``initialize()``, before the first parameter is broadcast, the data-parallel ranks
compare a fingerprint of their model (every parameter's name, shape and dtype, in order): one all-gather of
a 32-byte digest. Only when the digests differ are the lists gathered, and every rank raises the same
``ModelMismatchError`` naming the first parameter that differs and the ranks that differ. (Gloo would abort
the process in native code on a broadcast of mismatched sizes; a rank with an extra layer would wait in a
broadcast its peers never join.)
"""

from __future__ import annotations

import hashlib
from typing import Any

from torch import nn

from .. import comm


class ModelMismatchError(ValueError):
    """The data-parallel ranks built different models."""


def model_fingerprint(module: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, full shape, dtype)`` of every parameter (a ZeRO-3 placeholder reports its full shape)."""
    from ..zero.stage3 import shard_of

    out = []
    for name, p in module.named_parameters():
        shard = shard_of(p)
        shape = tuple(shard.shape) if shard is not None else tuple(p.shape)
        out.append((name, tuple(int(d) for d in shape), str(p.dtype).removeprefix("torch.")))
    return out


def _first_difference(mine: list[Any], theirs: list[Any]) -> str:
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return (f"parameter #{i}: {a[0]!r} shape {list(a[1])} {a[2]} on rank 0, {b[0]!r} shape {list(b[1])} "
                    f"{b[2]} on the other")
    if len(mine) != len(theirs):
        longer, n = (mine, "rank 0") if len(mine) > len(theirs) else (theirs, "the other")
        extra = longer[min(len(mine), len(theirs))]
        return (f"rank 0 has {len(mine)} parameters, the other {len(theirs)}; the first extra one is {extra[0]!r} "
                f"(shape {list(extra[1])}) on {n}")
    return "the parameter lists differ"


def check_same_model(module: nn.Module, group: Any) -> None:
    """Collective over ``group``: raise ``ModelMismatchError`` on every rank unless all ranks built the same
    model (see the module docstring)."""
    if comm.get_world_size(group) == 1:
        return
    entries = model_fingerprint(module)
    digest = hashlib.sha256(repr(entries).encode()).hexdigest()
    digests = comm.all_gather_object(digest, group=group)
    if len(set(digests)) == 1:
        return
    lists = comm.all_gather_object(entries, group=group)
    bad = [r for r, d in enumerate(digests) if d != digests[0]]
    detail = _first_difference(lists[0], lists[bad[0]]).replace("the other", f"rank {bad[0]}")
    raise ModelMismatchError(f"initialize(): the data-parallel ranks built different models (rank(s) {bad} differ "
                             f"from rank 0): {detail}. Every rank must build the same model")


class MicroStepMisaligned(RuntimeError):
    """The data-parallel ranks are at different micro-steps (a forward without its backward on some rank)."""


class MicroStepCheck:
    """Detects ranks that fell out of step between ``engine(...)`` and ``engine.backward()``.

    A rank whose own code raised after the forward and before the backward (caught, as docs/recovery.md
    suggests) runs one forward more than its peers; its next backward would reduce its batch k+1 with the
    peers' batch k for the rest of the run. So each rank counts its training forwards (grad enabled, module
    in training mode) and, at the start of every backward, the ranks compare the count with one 8-byte
    all-reduce (max of ``[n, -n]``). A difference raises ``MicroStepMisaligned`` on every rank inside the
    backward, which abandons the accumulation window everywhere (the recovery path); the counts restart
    from zero, so the ranks are aligned again. Two forwards before one backward stay fine when every rank
    does the same.
    """

    def __init__(self) -> None:
        self.forwards = 0

    def forward_seen(self, module: nn.Module) -> None:
        import torch

        if module.training and torch.is_grad_enabled():
            self.forwards += 1

    def reset(self) -> None:
        self.forwards = 0

    def check(self, group: Any) -> None:
        import torch

        if comm.get_world_size(group) == 1:
            return
        counts = torch.tensor([float(self.forwards), -float(self.forwards)], device=comm.device_for_backend(group))
        comm.all_reduce_flags(counts, group=group)  # MAX, logged as a control message (not gradient volume)
        high, low = int(counts[0]), int(-counts[1])
        if high != low:
            raise MicroStepMisaligned(
                f"the data-parallel ranks are at different micro-steps: between {low} and {high} training "
                f"forwards since the last realignment, this rank {self.forwards} (an exception between engine(...) "
                "and engine.backward() on some rank?). The accumulation window is abandoned on every rank; "
                "continue with the next batch")
