"""Which gradients have arrived, and which bucket's collective may launch next (pure bookkeeping, no tensors).

Buckets are numbered by *position* in one launch order, the same on every rank. A bucket is complete
when every parameter it expects has sent its gradient in this micro-step; buckets launch strictly in
order, so a complete bucket waits for every earlier one. A parameter that got no gradient on any rank in
the first backward (``learn_unused``) is no longer expected, until it gets one late (``readmit``).
"""

from __future__ import annotations

from collections.abc import Sequence

Key = tuple[int, int]  # (group, parameter index in the group)


class ArrivalTracker:
    def __init__(self, buckets: Sequence[Sequence[Sequence[int]]], group_order: Sequence[int] | None = None) -> None:
        """``buckets[g][b]``: the parameter indices of bucket b of group g; ``group_order``: the groups' launch
        order (default: as numbered)."""
        order = range(len(buckets)) if group_order is None else group_order
        self.order: list[tuple[int, int]] = [(g, b) for g in order for b in range(len(buckets[g]))]
        self.members = [tuple(buckets[g][b]) for g, b in self.order]
        position = {key: k for k, key in enumerate(self.order)}
        self.bucket_of: dict[Key, int] = {(g, i): position[(g, b)] for g, b in self.order for i in buckets[g][b]}
        self.expected = [len(m) for m in self.members]
        self.arrived = [0] * len(self.order)
        self.next_launch = 0
        self.got: set[Key] = set()  # took a gradient in this micro-step
        self.window_got: set[Key] = set()  # ... since the last zero() (the accumulation window)
        self.unused: set[Key] | None = None  # learned from the first backward (the same on every rank)

    def keys(self, groups: Sequence[int] | None = None) -> list[Key]:
        """Every (group, index), in group then index order (only ``groups``' when given)."""
        return sorted(k for k in self.bucket_of if groups is None or k[0] in groups)

    def is_unused(self, key: Key) -> bool:
        return self.unused is not None and key in self.unused

    def take(self, key: Key) -> bool:
        """``key``'s gradient arrived; True when its bucket became complete by it (unused parameters don't count)."""
        self.got.add(key)
        if self.is_unused(key):
            return False
        k = self.bucket_of[key]
        self.arrived[k] += 1
        return self.arrived[k] >= self.expected[k]

    def pop_ready(self) -> int | None:
        """The next bucket if it is complete (and count it launched), else None."""
        k = self.next_launch
        if k < len(self.order) and self.arrived[k] >= self.expected[k]:
            self.next_launch += 1
            return k
        return None

    def pop_next(self) -> int | None:
        """The next bucket, complete or not (the end of backward launches everything left)."""
        if self.next_launch >= len(self.order):
            return None
        self.next_launch += 1
        return self.next_launch - 1

    def launched(self, key: Key) -> bool:
        """Whether ``key``'s bucket has been launched in this micro-step (a gradient for it now is late)."""
        return self.bucket_of[key] < self.next_launch

    def learn_unused(self, unused: set[Key]) -> None:
        """After the first backward: these parameters (no gradient on any rank) count as arrived from now on."""
        self.unused = set(unused)
        for key in self.unused:
            self.expected[self.bucket_of[key]] -= 1

    def readmit(self, k: int) -> None:
        """Bucket k's unused parameters sent gradients late: wait for them again from now on."""
        g = self.order[k][0]
        for i in self.members[k]:
            if self.is_unused((g, i)):
                self.unused.discard((g, i))  # type: ignore[union-attr]
                self.expected[k] += 1

    def begin(self) -> None:
        self.got = set()

    def end_micro_step(self, relaunch: bool) -> None:
        """Fold this micro-step's arrivals into the window; ``relaunch``: the launches were all done."""
        self.window_got |= self.got
        self.arrived = [0] * len(self.order)
        if relaunch:
            self.next_launch = 0

    def missing(self) -> list[Key]:
        """Parameters that got no gradient in the whole accumulation window."""
        return [k for k in self.keys() if k not in self.window_got]

    def zero(self) -> None:
        self.window_got = set()

    def reset(self) -> None:
        """Forget the micro-step (after an error)."""
        self.next_launch = 0
        self.arrived = [0] * len(self.order)
        self.got = set()
