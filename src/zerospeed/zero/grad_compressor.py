"""How a bucket travels: densely (the reducer's own all-reduce / reduce-scatter), as rows, or top-k sparsified.

``DenseCompressor`` takes only the buckets of ``row_sparse`` (``sparse_gradients``, stage 0: an embedding
weight alone in its bucket travels as its nonzero rows and their indices, ``comm.row_sparse_all_reduce``).
``TopKCompressor`` (``gradient_compression.type: topk``) takes every other bucket too once ``steps``
(optimizer steps, advanced by ``ZeroOptimizer``) reaches the warm-up: every rank gets the dense sum of each
rank's top-k entries (``comm.sparse_all_reduce``), as from an all-reduce, with error feedback (a per-bucket
residual of what was not sent). After the variance freeze the optimizer may set ``scale`` (preconditioned
selection: rank entries by ``|g| * scale``) and ``momentum`` (DGC's momentum correction: per group, beta1 of
each rank's own momentum, which is then what is exchanged).
"""

from __future__ import annotations

import torch

from .. import comm

Key = tuple[int, int]  # (group, bucket)


class DenseCompressor:
    def __init__(self, row_sparse: dict[Key, tuple[int, int]] | None = None) -> None:
        self.row_sparse = dict(row_sparse or {})  # bucket -> (rows, columns) of its one parameter
        self.steps = 0  # optimizer steps taken (ZeroOptimizer.set_compression_steps)
        self.scale: dict[Key, torch.Tensor] = {}
        self.momentum: dict[int, float] = {}
        self.residual: dict[Key, torch.Tensor] = {}

    def takes(self, key: Key) -> bool:
        """Whether bucket ``key`` is reduced here instead of by a dense collective."""
        return key in self.row_sparse

    def all_reduce(self, key: Key, send: torch.Tensor, group: comm.Group | None) -> None:
        """Replace ``send`` by its sum over the ranks (synchronous)."""
        comm.row_sparse_all_reduce(send.view(self.row_sparse[key]), group)


class TopKCompressor(DenseCompressor):
    def __init__(self, ratio: float, error_feedback: bool = True, warmup_steps: int = 0,
                 row_sparse: dict[Key, tuple[int, int]] | None = None) -> None:
        super().__init__(row_sparse)
        self.ratio, self.error_feedback, self.warmup_steps = ratio, error_feedback, warmup_steps
        self.velocity: dict[Key, torch.Tensor] = {}  # DGC: each rank's momentum, per bucket

    def takes(self, key: Key) -> bool:
        return super().takes(key) or self.steps >= self.warmup_steps

    def all_reduce(self, key: Key, send: torch.Tensor, group: comm.Group | None) -> None:
        """Replace ``send`` by the sum over ranks of each rank's top-k (synchronous)."""
        if key in self.row_sparse:
            super().all_reduce(key, send, group)
            return
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
