"""Megatron's interleaved 1F1B: each rank holds ``chunks`` model chunks (virtual stages).

With ``p`` ranks and ``v`` chunks the model is cut into ``p * v`` virtual stages; rank ``r`` holds virtual
stages ``r, r + p, r + 2p, ...`` (chunk ``c`` is virtual stage ``c * p + r``), so a micro-batch crosses the
ranks ``v`` times. Forward work is ordered in groups of ``p`` micro-batches per chunk, which lets a rank
start its second chunk before the first micro-batch has come back, shrinking the bubble from
``(p - 1) / (m + p - 1)`` to about ``(p - 1) / (v * m + p - 1)``. Needs ``micro_batches % p == 0``.

Every instruction carries ``chunk``; buffer ``chunk * micro_batches + micro_batch`` holds one
micro-batch of one chunk. Communication instructions sit right next to the compute they feed.
"""

from __future__ import annotations

from collections.abc import Iterator

from .schedule import (BackwardPass, ForwardPass, LoadMicroBatch, OptimizerStep, PipeInstruction, PipeSchedule,
                       RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad)


class InterleavedSchedule(PipeSchedule):
    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 2) -> None:
        super().__init__(micro_batches, stages, stage_id)
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        if stages < 2:
            raise ValueError("the interleaved schedule needs at least 2 pipeline stages")
        if micro_batches % stages != 0:
            raise ValueError(f"the interleaved schedule needs micro-batches ({micro_batches}) divisible by the "
                             f"pipeline stages ({stages}); change gradient_accumulation_steps")
        self.chunks = chunks

    def num_pipe_buffers(self) -> int:
        return self.chunks * self.micro_batches

    def _virtual(self, k: int, forward: bool) -> tuple[int, int]:
        """Virtual micro-batch k -> (chunk, micro-batch)."""
        p, v = self.stages, self.chunks
        group, pos = divmod(k, p * v)
        chunk = pos // p
        if not forward:
            chunk = v - 1 - chunk
        return chunk, group * p + pos % p

    def _forward(self, k: int) -> list[PipeInstruction]:
        c, mb = self._virtual(k, True)
        vs, last = c * self.stages + self.stage_id, self.stages * self.chunks - 1
        buf = c * self.micro_batches + mb
        cmds: list[PipeInstruction] = []
        if vs > 0:
            cmds.append(RecvActivation(buf, chunk=c))
        if vs == 0 or vs == last:
            cmds.append(LoadMicroBatch(buf, chunk=c))
        cmds.append(ForwardPass(buf, chunk=c))
        if vs < last:
            cmds.append(SendActivation(buf, chunk=c))
        return cmds

    def _backward(self, k: int) -> list[PipeInstruction]:
        c, mb = self._virtual(k, False)
        vs, last = c * self.stages + self.stage_id, self.stages * self.chunks - 1
        buf = c * self.micro_batches + mb
        cmds: list[PipeInstruction] = []
        if vs < last:
            cmds.append(RecvGrad(buf, chunk=c))
        cmds.append(BackwardPass(buf, chunk=c))
        if vs > 0:
            cmds.append(SendGrad(buf, chunk=c))
        return cmds

    def steps(self) -> Iterator[list[PipeInstruction]]:
        p, total = self.stages, self.micro_batches * self.chunks
        if self.micro_batches == p:
            warmup = total
        else:
            warmup = min(total, (p - self.stage_id - 1) * 2 + (self.chunks - 1) * p)
        steady = total - warmup
        for k in range(warmup):
            yield self._forward(k)
        for k in range(steady):
            yield self._forward(k + warmup) + self._backward(k)
        for k in range(steady, total):
            yield self._backward(k)
        yield [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
