"""The ZeRO optimizer across pipeline stages: one gradient norm and one overflow verdict for the whole model.

Each stage holds only its own layers, so the global gradient norm (for clipping) sums the squares over the
data-parallel shards *and* over the stages, counting a tied weight once (its copies on other stages hold
the same summed gradient and are skipped). An fp16 overflow on any stage skips the step on every stage.
Everything else (buckets, ZeRO-1 partitions, master weights, offload) is the data-parallel ZeRO optimizer
over the pipeline's data-parallel group.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ... import comm
from ...zero import ZeroOptimizer


class PipelineZeroOptimizer(ZeroOptimizer):
    pipe_group: Any = None
    replicated: frozenset[int] = frozenset()

    @classmethod
    def wrap(cls, opt: ZeroOptimizer, pipe_group: Any, replicated: set[int]) -> "PipelineZeroOptimizer":
        """The same optimizer (state shared, nothing copied) with pipeline-wide norm and overflow."""
        out = cls.__new__(cls)
        out.__dict__.update(opt.__dict__)
        out.pipe_group = pipe_group
        out.replicated = frozenset(replicated)
        return out

    def _has_overflow(self, grads: list[torch.Tensor]) -> bool:
        local = super()._has_overflow(grads)
        return comm.all_reduce_max_flag(local, group=self.pipe_group)

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
        for grp, g in zip(self.groups, grads):
            sq += torch.linalg.vector_norm(g, dtype=torch.float32).square()
            for i, p in enumerate(grp.params):
                if id(p) in self.replicated:
                    sq -= torch.linalg.vector_norm(grp.slot_view(g, i), dtype=torch.float32).square()
        sq = sq.to(comm.device_for_backend(self.dp_group)).reshape(1)
        if self.partitioned:
            comm.all_reduce(sq, group=self.dp_group)
        comm.all_reduce(sq, group=self.pipe_group)
        return math.sqrt(max(float(sq), 0.0))
