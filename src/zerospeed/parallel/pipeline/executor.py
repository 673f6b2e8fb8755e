"""The stage executor: runs one schedule (a pure instruction list) on this stage, one instruction at a time,
through one table. It holds the micro-batch buffers, the p2p channels and the per-batch accounting; what it
needs from the engine that owns it (the next batch, the gradient reducer, the loss scale, the observer, the
optimizer step) comes through a :class:`StageHost` handed in, so this package never imports the engine
(DeepSpeed's ``PipelineEngine`` facade lives in ``runtime/pipeline_engine.py``).

The last stage divides its loss by the micro-batch count before backward; earlier stages backpropagate the
gradient they receive unchanged (no second scaling). Per batch it accounts compute seconds (forward +
backward), the seconds spent waiting to receive (the bubble and transfer time), and the p2p bytes sent and
received: :attr:`StageExecutor.last_step_stats`.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Protocol

import torch

from ... import comm
from .accounting import PipeStepStats
from .channel import Channels, as_tuple
from .module import PipelineError, PipelineModule, get_attr_path
from .schedule import (BackwardPass, ForwardPass, LoadMicroBatch, OptimizerStep, PipeInstruction, PipeSchedule,
                       RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad)


class StageHost(Protocol):
    """The engine side of a stage: what the instructions call out to."""

    observer: Any  # forward/backward/step timers and the progress line (runtime/observer.py)
    loss_scale: float  # the loss scaler's current scale (1 without fp16)

    def next_batch(self) -> Any: ...

    def stage_reducer(self) -> Any: ...

    def pipeline_step(self) -> None: ...


class _Buffer:
    __slots__ = ("inputs", "labels", "outputs", "loss", "out_grads", "micro_batch")

    def __init__(self) -> None:
        self.inputs: Any = None
        self.labels: Any = None
        self.outputs: Any = None
        self.loss: Any = None
        self.out_grads: Any = None
        self.micro_batch = -1


class StageExecutor:
    """Executes schedules for stage ``stage_id`` of ``module`` (``chunks`` virtual stages) over ``grid``."""

    def __init__(self, module: PipelineModule, grid: Any, channels: Channels, device: torch.device,
                 host: StageHost) -> None:
        self.module, self.grid, self.channels, self.device, self.host = module, grid, channels, device, host
        self.num_stages = grid.get_pipe_parallel_world_size()
        self.stage_id = grid.get_stage_id()
        self.chunks = module.virtual_stages
        self.micro_batches = 1
        self.compute_loss = True
        self.return_logits = False
        self.outputs: Any = None  # the last stage's logits of the latest micro-batch (eval_batch(return_logits))
        self.fwd_outputs: list[Any] = []
        self.total_loss: torch.Tensor | None = None
        self.last_step_stats = PipeStepStats()
        self._buffers: list[_Buffer] = []
        self._stats = PipeStepStats()
        self._recvs_left: Counter[tuple[type, int]] = Counter()
        self._batch_t0 = 0.0
        self._table = {
            LoadMicroBatch: self._exec_load_micro_batch, ForwardPass: self._exec_forward_pass,
            BackwardPass: self._exec_backward_pass, SendActivation: self._exec_send_activations,
            RecvActivation: self._exec_recv_activations, SendGrad: self._exec_send_grads,
            RecvGrad: self._exec_recv_grads, ReduceTiedGrads: self._exec_reduce_tied_grads,
            ReduceGrads: self._exec_reduce_grads, OptimizerStep: self._exec_optimizer_step,
        }

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    # --- the instruction loop ----------------------------------------------------------------------
    def run(self, schedule: PipeSchedule) -> None:
        self._buffers = [_Buffer() for _ in range(schedule.num_pipe_buffers())]
        self._stats = PipeStepStats()
        sent0, recv0 = self.channels.bytes_sent, self.channels.bytes_received
        t0 = self._batch_t0 = time.perf_counter()
        steps = [list(step) for step in schedule]
        # receives still to come per (kind, chunk): a receive posts the next one ahead only if one follows
        self._recvs_left = Counter((type(c), getattr(c, "chunk", 0)) for step in steps for c in step
                                   if isinstance(c, (RecvActivation, RecvGrad)))
        try:
            for step in steps:
                for cmd in step:
                    self._execute(cmd)
            self.channels.finish()
        except BaseException:
            self.channels.prefetched.clear()  # a failed batch: receives posted ahead are abandoned with it
            raise
        finally:
            self._buffers = []
        st = self._stats
        st.total_seconds = time.perf_counter() - t0
        st.other_seconds = max(0.0, st.total_seconds - st.compute_seconds - st.recv_wait_seconds
                               - st.reduce_step_seconds)
        st.p2p_bytes_sent = self.channels.bytes_sent - sent0
        st.p2p_bytes_received = self.channels.bytes_received - recv0
        self.last_step_stats = st

    def _execute(self, cmd: PipeInstruction) -> None:
        handler = self._table.get(type(cmd))
        if handler is None:
            raise RuntimeError(f"{self.__class__.__name__} does not understand instruction {cmd!r}")
        if isinstance(cmd, (ReduceTiedGrads, ReduceGrads, OptimizerStep)):
            t0 = time.perf_counter()
            handler(cmd)
            self._stats.reduce_step_seconds += time.perf_counter() - t0
        else:
            handler(cmd)

    def _to_device(self, x: Any) -> Any:
        if torch.is_tensor(x):
            return x.detach().to(self.device)
        if isinstance(x, (tuple, list)):
            return tuple(self._to_device(t) for t in x)
        return x

    # --- peers -------------------------------------------------------------------------------------
    def _next(self, chunk: int) -> tuple[int, int]:
        """(global rank, tag) for activations leaving ``chunk`` of this stage."""
        last = self.stage_id == self.num_stages - 1
        to_chunk = chunk + 1 if last else chunk
        return self.grid.stage_to_global((self.stage_id + 1) % self.num_stages), 2 * to_chunk

    def _prev(self, chunk: int) -> tuple[int, int]:
        """(global rank, tag) for gradients leaving ``chunk`` of this stage (towards the previous stage)."""
        first = self.stage_id == 0
        to_chunk = chunk - 1 if first else chunk
        return self.grid.stage_to_global((self.stage_id - 1) % self.num_stages), 2 * to_chunk + 1

    def _is_first_virtual(self, chunk: int) -> bool:
        return self.stage_id == 0 and chunk == 0

    def _is_last_virtual(self, chunk: int) -> bool:
        return self.stage_id == self.num_stages - 1 and chunk == self.chunks - 1

    def _timed(self, t0: float, kind: str) -> None:
        end = time.perf_counter()
        self._stats.compute_seconds += end - t0
        setattr(self._stats, kind, getattr(self._stats, kind) + end - t0)
        self._stats.pipeline_seconds = end - self._batch_t0

    # --- instructions ------------------------------------------------------------------------------
    def _exec_load_micro_batch(self, cmd: PipeInstruction) -> None:
        chunk = getattr(cmd, "chunk", 0)
        batch = self.host.next_batch()
        buf = self._buffers[cmd.buffer_id]  # type: ignore[attr-defined]
        if self._is_first_virtual(chunk):
            buf.inputs = self._to_device(batch[0])
        if self._is_last_virtual(chunk):
            buf.labels = self._to_device(batch[1])

    def _exec_forward_pass(self, cmd: PipeInstruction) -> None:
        chunk = getattr(cmd, "chunk", 0)
        buf = self._buffers[cmd.buffer_id]  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        self.host.observer.forward_start()
        outputs = self.module(buf.inputs, chunk=chunk) if self.chunks > 1 else self.module(buf.inputs)
        self.host.observer.forward_end()
        if self._is_last_virtual(chunk):
            if self.compute_loss and self.module.loss_fn is not None:
                loss = self.module.loss_fn(outputs, buf.labels)
            else:
                loss = outputs
            buf.loss = loss
            if self.return_logits:
                self.outputs = outputs
            if torch.is_tensor(loss):
                detached = loss.detach()
                self.total_loss = detached.clone() if self.total_loss is None else self.total_loss + detached
                self.fwd_outputs.append(detached)
            else:
                self.fwd_outputs.append([t.detach() for t in loss])
        else:
            buf.outputs = outputs
        self._timed(t0, "forward_seconds")

    def _exec_backward_pass(self, cmd: PipeInstruction) -> None:
        chunk = getattr(cmd, "chunk", 0)
        buf = self._buffers[cmd.buffer_id]  # type: ignore[attr-defined]
        reducer = self.host.stage_reducer()
        t0 = time.perf_counter()
        reducer.begin_micro_step(False)  # accumulate locally; ReduceGrads communicates once per batch
        if self._is_last_virtual(chunk):
            if not torch.is_tensor(buf.loss) or buf.loss.numel() != 1:
                raise ValueError("the last stage must produce a scalar loss (set PipelineModule(loss_fn=...))")
            scaled = buf.loss.float() / self.micro_batches
            scale = self.host.loss_scale
            if scale != 1.0:
                scaled = scaled * scale
            self.host.observer.backward_start(buf.loss)
            scaled.backward()
        else:
            outs = [t for t in as_tuple(buf.outputs) if t.requires_grad]
            if len(outs) != len(buf.out_grads):
                raise PipelineError(f"stage {self.stage_id}: {len(outs)} outputs need gradients but "
                                    f"{len(buf.out_grads)} gradients arrived")
            self.host.observer.backward_start(torch.zeros(()))
            torch.autograd.backward(outs, buf.out_grads)
        reducer.end_micro_step()
        self.host.observer.backward_end()
        buf.outputs, buf.out_grads, buf.loss = None, None, None
        self._timed(t0, "backward_seconds")

    def _more(self, kind: type, chunk: int) -> bool:
        """Count this receive; whether another of its kind into ``chunk`` follows in this batch."""
        self._recvs_left[(kind, chunk)] -= 1
        return self._recvs_left[(kind, chunk)] > 0

    def _exec_send_activations(self, cmd: PipeInstruction) -> None:
        buf = self._buffers[cmd.buffer_id]  # type: ignore[attr-defined]
        peer, tag = self._next(getattr(cmd, "chunk", 0))
        self.channels.send_activations(buf.outputs, peer, tag)

    def _exec_recv_activations(self, cmd: PipeInstruction) -> None:
        buf = self._buffers[cmd.buffer_id]  # type: ignore[attr-defined]
        chunk = getattr(cmd, "chunk", 0)
        t0 = time.perf_counter()
        got = self.channels.recv_activations(self._prev(chunk)[0], 2 * chunk, self._more(RecvActivation, chunk))
        self._stats.recv_wait_seconds += time.perf_counter() - t0
        if not torch.is_grad_enabled():
            got = tuple(t.detach() for t in got)
        buf.inputs = got[0] if len(got) == 1 else got

    def _exec_send_grads(self, cmd: PipeInstruction) -> None:
        buf = self._buffers[cmd.buffer_id]  # type: ignore[attr-defined]
        peer, tag = self._prev(getattr(cmd, "chunk", 0))
        grads = [t.grad if t.grad is not None else torch.zeros_like(t)
                 for t in as_tuple(buf.inputs) if t.requires_grad]
        self.channels.send_grads(grads, peer, tag)
        buf.inputs = None

    def _exec_recv_grads(self, cmd: PipeInstruction) -> None:
        buf = self._buffers[cmd.buffer_id]  # type: ignore[attr-defined]
        chunk = getattr(cmd, "chunk", 0)
        like = [t for t in as_tuple(buf.outputs) if t.requires_grad]
        t0 = time.perf_counter()
        buf.out_grads = self.channels.recv_grads(like, self._next(chunk)[0], 2 * chunk + 1, self._more(RecvGrad, chunk))
        self._stats.recv_wait_seconds += time.perf_counter() - t0

    def _exec_reduce_tied_grads(self, cmd: PipeInstruction) -> None:
        """Sum each tied weight's accumulated gradient over the stages holding it (in the ZeRO grad buffer)."""
        reducer = self.host.stage_reducer()
        for key, info in self.module.tied_comms.items():
            for attr in info["weight_attr"]:
                param = get_attr_path(self.module.tied_modules[key], attr)
                block = reducer.grad_block(param)
                if block is None:
                    continue  # frozen
                summed = block.contiguous()
                comm.all_reduce(summed, group=info["group"])
                block.copy_(summed)

    def _exec_reduce_grads(self, cmd: PipeInstruction) -> None:
        reducer = self.host.stage_reducer()
        reducer.begin_micro_step(True)
        reducer.end_micro_step()

    def _exec_optimizer_step(self, cmd: PipeInstruction) -> None:
        self.channels.finish()  # no send may still read a buffer the step rewrites
        self.host.pipeline_step()
