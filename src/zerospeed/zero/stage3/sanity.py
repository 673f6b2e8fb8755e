"""``zero_optimization.enable_sanity_checks``: a stage-3 check that costs a collective, and raises a named error.

* :class:`VersionGuard` (``GatheredParameters`` without ``modifier_rank``): a parameter changed in place
  inside the block would be lost at release (DeepSpeed's check); every rank learns whether any rank changed
  one and raises :class:`ModifiedWithoutModifierError` naming them.

Off by default, as in DeepSpeed. DeepSpeed's other checks are always on here: every rank built the same model
(``runtime/lockstep.py``, at ``initialize``: so every rank's buckets hold the same parameters), and every
stage-3 gather is the same on all ranks (``zero/stage3/lockstep.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ... import comm


class SanityCheckError(RuntimeError):
    """A ZeRO-3 sanity check (``enable_sanity_checks``) failed."""


class ModifiedWithoutModifierError(SanityCheckError):
    """Parameters changed inside ``GatheredParameters(modifier_rank=None)``: the change would be lost."""


def _state(p: torch.Tensor) -> tuple[int, int, bytes]:
    """Storage, in-place version and a checksum of the values (writes through ``p.data`` bump no version)."""
    values = p.detach().reshape(-1).double()
    return p.data.data_ptr(), p._version, torch.stack([values.sum(), (values * values).sum()]).numpy().tobytes()


class VersionGuard:
    """Each parameter's storage, version and checksum at entry; ``check`` compares at exit (collective)."""

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], group: comm.Group | None) -> None:
        self.group = group
        self.names = list(names)
        self.seen = [(p, _state(p)) for p in params]

    def check(self) -> None:
        changed = [n for n, (p, state) in zip(self.names, self.seen) if _state(p) != state]
        if comm.all_reduce_max_flag(bool(changed), group=self.group):
            raise ModifiedWithoutModifierError(
                f"rank {comm.get_rank(self.group)}: parameters were changed in place inside "
                f"GatheredParameters(modifier_rank=None) ({', '.join(changed[:5]) or 'on another rank'}); the "
                "change is dropped when the block releases them. Pass modifier_rank=<rank> to keep it "
                "(enable_sanity_checks, as DeepSpeed).")


__all__ = ["ModifiedWithoutModifierError", "SanityCheckError", "VersionGuard"]
