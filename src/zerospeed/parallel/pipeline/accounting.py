"""What one pipeline batch cost this rank: measured seconds by kind and p2p bytes (``engine.last_step_stats``).

The bubble of pipeline theory, (p - 1) / (m + p - 1) for 1F1B with equal stages, is each stage's idle time
over the *pipeline's* span (first forward anywhere to last backward anywhere). One rank cannot see that span:
the last stage finishes its backwards (p - 1) backward-times before the first stage does, so its own span
misses that tail of idle time. ``pipeline_bubble`` takes the stats of every stage of one pipeline and
measures each stage against the longest span (the first stage's, which starts first and ends last).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class PipeStepStats:
    """One ``train_batch``/``eval_batch`` on this rank: measured seconds and bytes."""

    total_seconds: float = 0.0
    compute_seconds: float = 0.0  # forward + backward (incl. loss)
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    pipeline_seconds: float = 0.0  # batch start -> end of this rank's last forward/backward
    recv_wait_seconds: float = 0.0  # blocked on a receive: pipeline bubble + transfer time
    reduce_step_seconds: float = 0.0  # tied-gradient and data-parallel reductions, optimizer step
    other_seconds: float = 0.0  # loading, posting sends, bookkeeping
    p2p_bytes_sent: int = 0
    p2p_bytes_received: int = 0

    @property
    def bubble_fraction(self) -> float:
        """Idle share of this rank's *own* pipelined span, 1 - compute / pipeline_seconds: a lower bound on
        the theory's bubble (a stage that finishes early does not see the pipeline's tail); the theory's
        figure needs every stage: ``pipeline_bubble``."""
        return max(0.0, 1.0 - self.compute_seconds / self.pipeline_seconds) if self.pipeline_seconds > 0 else 0.0


def pipeline_bubble(stages: Sequence[PipeStepStats]) -> list[float]:
    """Each stage's idle fraction of the pipeline's span (the longest ``pipeline_seconds`` among the stages
    of one pipeline, in stage order): the quantity (p - 1) / (m + p - 1) predicts for equal stages."""
    span = max((s.pipeline_seconds for s in stages), default=0.0)
    return [max(0.0, 1.0 - s.compute_seconds / span) if span > 0 else 0.0 for s in stages]
