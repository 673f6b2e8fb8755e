"""Pipeline schedules: pure generators of instruction lists (no processes, no tensors).

A schedule is built for one stage and yields one list of :class:`PipeInstruction` per step; a barrier
between steps could never deadlock. Buffers are slots a stage keeps activations in between a micro-batch's
forward and backward. The engine executes every schedule through one instruction table, so a new schedule
is just a new generator. Classes and step order follow DeepSpeed (``TrainSchedule`` is its synchronous
1F1B); ``InterleavedSchedule`` is Megatron's interleaved 1F1B with virtual stages, which DeepSpeed lacks.

TrainSchedule for 2 stages and 3 micro-batches (F/B: forward/backward of micro-batch i)::

    step:     0    1    2    3    4    5    6    7
    stage 0:  F0   .    F1   B0   F2   B1   .    B2   + reduce tied grads, reduce grads, optimizer step
    stage 1:  .    F0   B0   F1   B1   F2   B2   .
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any


def call_to_str(name: str, *args: Any, **kwargs: Any) -> str:
    """``name(arg, ..., key=value)`` with each value's repr (an instruction's text; DeepSpeed's ``runtime.utils`` name)."""
    return f"{name}({', '.join([*(repr(a) for a in args), *(f'{k}={v!r}' for k, v in kwargs.items())])})"


class PipeInstruction:
    """One thing a stage does; keyword arguments become attributes (``buffer_id``, ``chunk`` ...)."""

    def __init__(self, **kwargs: Any) -> None:
        self.name = self.__class__.__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return call_to_str(self.name, **self.kwargs)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Apply the optimizer (and the LR schedule) once the batch's gradients are reduced."""


class ReduceGrads(PipeInstruction):
    """Reduce the stage's gradients over its data-parallel group."""


class ReduceTiedGrads(PipeInstruction):
    """Sum the gradients of tied weights (e.g. embedding and head) over the stages that hold them."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on one pipeline buffer (and, for virtual stages, one model chunk)."""

    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """First stage: load the next inputs into the buffer; last stage: the next labels."""


class ForwardPass(BufferOpInstruction):
    """Run the stage's layers on the buffer's inputs; the last stage also computes the loss."""


class BackwardPass(BufferOpInstruction):
    """Backpropagate the buffer's outputs (last stage: its loss) into the stage's gradients."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's outputs to the next stage."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's outputs as this buffer's inputs."""


class SendGrad(BufferOpInstruction):
    """Send the gradients of the buffer's inputs to the previous stage."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradients of the buffer's outputs from the next stage."""


def _even(n: int) -> bool:
    return n % 2 == 0


class PipeSchedule(ABC):
    """Directs one stage through one batch of ``micro_batches`` micro-batches over ``stages`` stages."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        if micro_batches < 1 or stages < 1 or not 0 <= stage_id < stages:
            raise ValueError(f"bad schedule shape: micro_batches={micro_batches}, stages={stages}, stage_id={stage_id}")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    @abstractmethod
    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield the instructions of each step."""

    def num_pipe_buffers(self) -> int:
        """Buffers the engine must allocate for this stage."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def _buffer_idx(self, micro_batch_id: int) -> int:
        assert self._valid_micro_batch(micro_batch_id)
        return micro_batch_id % self.num_pipe_buffers()

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()


class InferenceSchedule(PipeSchedule):
    """Forward only, micro-batches streaming through the stages; two alternating buffers."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step_id in range(self.micro_batches + self.stages - 1):
            cmds: list[PipeInstruction] = []
            mb = step_id - self.stage_id
            if _even(self.stage_id):
                recv_buf, send_buf = step_id % 2, (step_id + 1) % 2
            else:
                recv_buf, send_buf = (step_id + 1) % 2, step_id % 2
            if (self.is_first_stage or self.is_last_stage) and self._valid_micro_batch(mb):
                cmds.append(LoadMicroBatch(recv_buf))
            send = self._valid_stage(self.next_stage) and self._valid_micro_batch(mb - 1)
            recv = self._valid_stage(self.prev_stage) and self._valid_micro_batch(mb)
            if _even(self.stage_id):  # even stages send first, odd ones receive first: no deadlock
                cmds += [SendActivation(send_buf)] if send else []
                cmds += [RecvActivation(recv_buf)] if recv else []
            else:
                cmds += [RecvActivation(recv_buf)] if recv else []
                cmds += [SendActivation(send_buf)] if send else []
            if self._valid_micro_batch(mb):
                cmds.append(ForwardPass(recv_buf))
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 2


class TrainSchedule(PipeSchedule):
    """Synchronous 1F1B: after a warm-up of forwards, each stage alternates forward and backward.

    ``2 * (micro_batches + stages - 1)`` steps; on step t stage s runs a forward when t and s have the same
    parity and a backward otherwise. The batch ends with ReduceTiedGrads, ReduceGrads, OptimizerStep.
    """

    def steps(self) -> Iterator[list[PipeInstruction]]:
        prev_mb = -1
        total = 2 * (self.micro_batches + self.stages - 1)
        for step_id in range(total):
            mb, is_forward = self._step_to_micro_batch(step_id)
            cmds: list[PipeInstruction] = []
            prev_ok, cur_ok = self._valid_micro_batch(prev_mb), self._valid_micro_batch(mb)
            prev_buf = self._buffer_idx(prev_mb) if prev_ok else -1
            cur_buf = self._buffer_idx(mb) if cur_ok else -1
            if is_forward:
                if prev_ok and self._valid_stage(self.prev_stage):
                    cmds.append(SendGrad(prev_buf))
                if cur_ok and self._valid_stage(self.prev_stage):
                    cmds.append(RecvActivation(cur_buf))
            else:
                if cur_ok and self._valid_stage(self.next_stage):
                    cmds.append(RecvGrad(cur_buf))
                if prev_ok and self._valid_stage(self.next_stage):
                    cmds.append(SendActivation(prev_buf))
            if (self.is_first_stage or self.is_last_stage) and is_forward and cur_ok:
                cmds.append(LoadMicroBatch(cur_buf))
            if cur_ok:
                cmds.append(ForwardPass(cur_buf) if is_forward else BackwardPass(cur_buf))
            if step_id == total - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            prev_mb = mb
            yield cmds

    def num_pipe_buffers(self) -> int:
        """Forwards in flight: the distance to the last stage (at least 2)."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def _step_to_micro_batch(self, step_id: int) -> tuple[int, bool]:
        s = self.stage_id
        if _even(step_id) == _even(s):  # forward step
            base = step_id // 2 if _even(step_id) else (step_id - 1) // 2
            return base - s // 2, True
        if _even(step_id):  # odd stage, even step: backward
            return step_id // 2 - self.stages + (s + 1) // 2, False
        return (step_id - 1) // 2 - self.stages + 1 + s // 2, False


class DataParallelSchedule(PipeSchedule):
    """No pipeline: forward and backward each micro-batch, reduce and step after the last."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step_id in range(self.micro_batches):
            cmds: list[PipeInstruction] = [LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0),
                                           BackwardPass(buffer_id=0)]
            if step_id == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1
