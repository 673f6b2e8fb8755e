"""How a bucket travels: densely (the reducer's own all-reduce / reduce-scatter) or top-k sparsified.

``DenseCompressor`` never takes a bucket. ``TopKCompressor`` (``gradient_compression.type: topk``) takes
every bucket once ``steps`` (optimizer steps, advanced by ``ZeroOptimizer``) reaches the warm-up: every rank
gets the dense sum of each rank's top-k entries (``comm.sparse_all_reduce``), as from an all-reduce, with
error feedback (a per-bucket residual of what was not sent). After the variance freeze the optimizer may set
``scale`` (preconditioned selection: rank entries by ``|g| * scale``) and ``momentum`` (DGC's momentum
correction: per group, beta1 of each rank's own momentum, which is then what is exchanged).
"""

from __future__ import annotations

import torch

from .. import comm

Key = tuple[int, int]  # (group, bucket)


class DenseCompressor:
    def __init__(self) -> None:
        self.steps = 0  # optimizer steps taken (ZeroOptimizer.set_compression_steps)
        self.scale: dict[Key, torch.Tensor] = {}
        self.momentum: dict[int, float] = {}
        self.residual: dict[Key, torch.Tensor] = {}

    def takes(self) -> bool:
        """Whether the next buckets are reduced here instead of by a dense collective."""
        return False

    def all_reduce(self, key: Key, send: torch.Tensor, group: comm.Group | None) -> None:
        raise NotImplementedError("the dense path reduces its own buckets")


class TopKCompressor(DenseCompressor):
    def __init__(self, ratio: float, error_feedback: bool = True, warmup_steps: int = 0) -> None:
        super().__init__()
        self.ratio, self.error_feedback, self.warmup_steps = ratio, error_feedback, warmup_steps
        self.velocity: dict[Key, torch.Tensor] = {}  # DGC: each rank's momentum, per bucket

    def takes(self) -> bool:
        return self.steps >= self.warmup_steps

    def all_reduce(self, key: Key, send: torch.Tensor, group: comm.Group | None) -> None:
        """Replace ``send`` by the sum over ranks of each rank's top-k (synchronous)."""
        residual = None
        if self.error_feedback:
            residual = self.residual.setdefault(key, torch.zeros(send.numel(), device=send.device))
        beta1 = self.momentum.get(key[0])
        if beta1 is not None:  # DGC's momentum correction: u = b1 u + (1 - b1) g on each rank, u is sent
            u = self.velocity.setdefault(key, torch.zeros(send.numel(), device=send.device))
            send.copy_(u.mul_(beta1).add_(send, alpha=1 - beta1))
        sent = comm.sparse_all_reduce(send, self.ratio, residual, group, self.scale.get(key))
        if beta1 is not None:
            u.index_fill_(0, sent, 0.0)  # momentum factor masking: what was sent leaves the momentum too
