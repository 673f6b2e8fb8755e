"""What one pipeline batch cost this rank: measured seconds by kind and p2p bytes (``engine.last_step_stats``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PipeStepStats:
    """One ``train_batch``/``eval_batch`` on this rank: measured seconds and bytes."""

    total_seconds: float = 0.0
    compute_seconds: float = 0.0  # forward + backward (incl. loss)
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    recv_wait_seconds: float = 0.0  # blocked on a receive: pipeline bubble + transfer time
    reduce_step_seconds: float = 0.0  # tied-gradient and data-parallel reductions, optimizer step
    other_seconds: float = 0.0  # loading, posting sends, bookkeeping
    p2p_bytes_sent: int = 0
    p2p_bytes_received: int = 0

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the pipelined part of the step: 1 - compute / (total - reductions and step)."""
        piped = self.total_seconds - self.reduce_step_seconds
        return max(0.0, 1.0 - self.compute_seconds / piped) if piped > 0 else 0.0
