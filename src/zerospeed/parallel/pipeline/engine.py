"""PipelineEngine: runs a PipelineModule's schedule, one instruction at a time, through one table.

``train_batch()`` pulls ``gradient_accumulation_steps`` micro-batches (first stage: inputs, last stage:
labels), executes the schedule (1F1B, or interleaved 1F1B when the module has virtual stages), sums tied
gradients, reduces gradients over the data-parallel group with the ZeRO optimizer and steps; it returns
the batch's mean loss on every stage. The last stage divides its loss by the micro-batch count before
backward; earlier stages backpropagate the gradient they receive unchanged (no second scaling).

Per step the engine accounts its compute seconds (forward + backward), the seconds spent waiting to
receive (the bubble and transfer time), and the p2p bytes it sent and received: ``last_step_stats``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from ... import comm
from ...runtime.engine import Engine
from .accounting import PipeStepStats
from .channel import Channels, as_tuple
from .eager import EagerTrainSchedule
from .interleaved import InterleavedSchedule
from .losses import broadcast_from_last, mean_loss_everywhere, reduce_outputs
from .module import PipelineError, PipelineModule, get_attr_path
from .schedule import (BackwardPass, ForwardPass, InferenceSchedule, LoadMicroBatch, OptimizerStep, PipeInstruction,
                       PipeSchedule, RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad,
                       TrainSchedule)


class _Buffer:
    __slots__ = ("inputs", "labels", "outputs", "loss", "out_grads", "micro_batch")

    def __init__(self) -> None:
        self.inputs: Any = None
        self.labels: Any = None
        self.outputs: Any = None
        self.loss: Any = None
        self.out_grads: Any = None
        self.micro_batch = -1


def check_pipeline_section(section: Any, module: Any) -> None:
    """The config's ``stages`` / ``partition`` / ``seed_layers`` must agree with the PipelineModule, which is
    what decides them (DeepSpeed reads none of the three and silently ignores a disagreeing value)."""
    from ...config import ConfigError

    if section.stages != "auto" and section.stages != module.num_stages:
        raise ConfigError("pipeline.stages", f"{section.stages} disagrees with the PipelineModule's "
                          f"{module.num_stages} stages; the module decides: set num_stages/topology there or "
                          "use \"auto\"")
    if section.partition != "best" and section.partition != module.partition_method:
        raise ConfigError("pipeline.partition", f"{section.partition!r} disagrees with the PipelineModule's "
                          f"partition_method {module.partition_method!r}; the module decides: set it there")
    if section.seed_layers and not module.seed_layers:
        raise ConfigError("pipeline.seed_layers", "true, but the PipelineModule was built with "
                          "seed_layers=False; the module decides: pass seed_layers=True to it")
    if section.schedule != "1f1b" and module.virtual_stages > 1:
        raise ConfigError("pipeline.schedule", f"{section.schedule!r} with virtual_stages="
                          f"{module.virtual_stages}: the interleaved schedule has its own warm-up; use \"1f1b\"")


class PipelineEngine(Engine):
    """DeepSpeed's PipelineEngine contract over zerospeed's ZeRO optimizer (stages 0 and 1)."""

    def __init__(self, module: PipelineModule, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        from ..tensor.model_init import tp_state

        if module.mpu().get_slice_parallel_world_size() > 1 and tp_state(module) is None:
            from ...config.errors import NotSupportedYetError

            raise NotSupportedYetError("tensor_parallel", "a pipeline topology with a 'model' (tensor-parallel) axis "
                                       "needs the tensor_parallel section (autotp_size) or tp_model_init")
        self.grid = module.mpu()
        self.mpu = self.grid
        self.num_stages = self.grid.get_pipe_parallel_world_size()
        self.stage_id = self.grid.get_stage_id()
        self.chunks = module.virtual_stages
        check_pipeline_section(self.config.pipeline, module)
        if self.config.pipeline.activation_checkpoint_interval > 0:
            module.set_checkpoint_interval(self.config.pipeline.activation_checkpoint_interval)
        self.micro_batch_size = self.train_micro_batch_size_per_gpu()
        self.micro_batches = self.gradient_accumulation_steps()
        self.is_pipe_parallel = self.num_stages > 1
        self.is_data_parallel = self.grid.get_data_parallel_world_size() > 1
        self.channels = Channels(self.grid.get_pipe_parallel_group(), comm.device_for_backend(
            self.grid.get_pipe_parallel_group()) if self.is_pipe_parallel else self.device, module.dynamic_shape)
        self.data_iterator: Iterator[Any] | None = None
        self.batch_fn: Any = None
        self.agg_train_loss: torch.Tensor | None = None
        self.last_step_stats = PipeStepStats()
        self.eval_return_logits = False
        self.outputs: Any = None
        self._buffers: list[_Buffer] = []
        self._compute_loss = True
        self._fwd_outputs: list[Any] = []
        self._total_loss: torch.Tensor | None = None
        self._stats = PipeStepStats()
        self._recvs_left: Counter[tuple[type, int]] = Counter()
        self._batch_t0 = 0.0
        self._train_iterator: Iterator[Any] | None = None
        if self.training_dataloader is not None:
            from ...data.repeating import RepeatingLoader

            self.set_dataiterator(iter(RepeatingLoader(self.training_dataloader)))
        self._table = {
            LoadMicroBatch: self._exec_load_micro_batch, ForwardPass: self._exec_forward_pass,
            BackwardPass: self._exec_backward_pass, SendActivation: self._exec_send_activations,
            RecvActivation: self._exec_recv_activations, SendGrad: self._exec_send_grads,
            RecvGrad: self._exec_recv_grads, ReduceTiedGrads: self._exec_reduce_tied_grads,
            ReduceGrads: self._exec_reduce_grads, OptimizerStep: self._exec_optimizer_step,
        }

    # --- DeepSpeed's surface -----------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def is_gradient_accumulation_boundary(self) -> bool:
        return True

    def set_dataiterator(self, iterator: Iterator[Any] | None) -> None:
        """The iterator micro-batches are drawn from (only the first and last stages read it)."""
        if self.is_first_stage() or self.is_last_stage():
            self.data_iterator = iterator

    def set_dataloader(self, loader: Any) -> None:
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def reset_activation_shape(self) -> None:
        """Forget the agreed activation shapes; the next transfer on every channel shakes hands again.
        Call it on every rank (between batches) when the shapes change, as in DeepSpeed."""
        self.channels.sent_meta.clear()
        self.channels.recv_meta.clear()

    def set_batch_fn(self, fn: Any) -> None:
        self.batch_fn = fn

    def deepspeed_io(self, dataset: Any, batch_size: int | None = None, route: Any = None, pin_memory: bool = True,
                     data_sampler: Any = None, collate_fn: Any = None, num_local_io_workers: Any = None) -> Any:
        """A loader giving this data-parallel replica its own slice of ``dataset`` (micro-batch sized)."""
        from ...runtime.dataloader import build_dataloader

        if data_sampler is not None or num_local_io_workers:
            raise NotImplementedError("deepspeed_io(data_sampler=..., num_local_io_workers=...) is not supported "
                                      "yet by zerospeed")
        return build_dataloader(dataset, batch_size or self.micro_batch_size, self.grid.get_data_parallel_rank(),
                                self.grid.get_data_parallel_world_size(), collate_fn,
                                self.config.dataloader_drop_last, seed=self.config.seed or 0)

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: bool | None = None) -> bool:
        """Collective over every rank: per-parameter (layer-indexed) state, loadable at any pipeline degree."""
        from .checkpoint import save_pipeline_checkpoint

        if exclude_frozen_parameters:
            raise NotImplementedError("save_checkpoint(exclude_frozen_parameters=True) of a pipeline engine "
                                      "is not supported yet by zerospeed")
        use_async = self.config.checkpoint.async_save if async_save is None else async_save
        save_pipeline_checkpoint(self, save_dir, tag, client_state, save_latest, self.config.comms_timeout_s,
                                 use_async)
        return True

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> Any:
        """Collective over every rank: returns ``(path, client_state)`` or ``(None, None)``."""
        from .checkpoint import load_pipeline_checkpoint

        if custom_load_fn is not None:
            raise NotImplementedError("custom_load_fn not supported w. pipeline parallelism")
        return load_pipeline_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                                        load_lr_scheduler_states, load_module_only)

    # --- batches -----------------------------------------------------------------------------------
    def _train_schedule(self) -> PipeSchedule:
        if self.chunks > 1:
            return InterleavedSchedule(self.micro_batches, self.num_stages, self.stage_id, self.chunks)
        if self.config.pipeline.schedule == "eager_1f1b":
            return EagerTrainSchedule(self.micro_batches, self.num_stages, self.stage_id)
        return TrainSchedule(self.micro_batches, self.num_stages, self.stage_id)

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on the next ``gradient_accumulation_steps`` micro-batches; the mean loss, on every stage."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if self.optimizer is None:
            raise RuntimeError("train_batch() needs an optimizer: set 'optimizer' in the config or pass one")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self._total_loss = None
        self._fwd_outputs = []
        self._compute_loss = True
        self.agg_train_loss = None
        with comm.recording(self.comms):  # this engine's collectives count in its own logger
            self._run(self._train_schedule())  # its optimizer step aggregates the loss (for the progress line too)
        if self.agg_train_loss is None:
            with torch.no_grad():
                self.agg_train_loss = self._aggregate_loss()
        return self.agg_train_loss

    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Forward ``num_micro_batches`` (default: the accumulation steps) micro-batches without gradients."""
        self.eval_return_logits = return_logits
        self.module.eval()
        self._compute_loss = compute_loss
        saved = self.data_iterator
        self.set_dataiterator(data_iter)
        micro_batches = self.micro_batches if num_micro_batches is None else num_micro_batches
        self._fwd_outputs = []
        self.outputs = None
        schedule: PipeSchedule = (InterleavedSchedule(micro_batches, self.num_stages, self.stage_id, self.chunks,
                                                      forward_only=True) if self.chunks > 1
                                  else InferenceSchedule(micro_batches, self.num_stages, self.stage_id))
        with torch.no_grad(), comm.recording(self.comms):
            self._run(schedule)
        out: Any = None
        if self.is_last_stage():
            out = self._reduce_outputs(self._fwd_outputs, reduce_output, micro_batches)
        if compute_loss and bcast_loss and self.is_pipe_parallel:
            out = self._bcast_from_last(out)
        self.set_dataiterator(saved)
        self.eval_return_logits = False
        if return_logits:
            logits, self.outputs = self.outputs, None
            return out, logits
        return out

    def _reduce_outputs(self, outputs: list[Any], reduce: str | None, micro_batches: int) -> Any:
        return reduce_outputs(outputs, reduce, micro_batches, self.grid)

    def _bcast_from_last(self, value: Any) -> torch.Tensor:
        return broadcast_from_last(value, self.grid)

    def _aggregate_loss(self) -> torch.Tensor:
        """Mean over micro-batches (last stage), averaged over data-parallel replicas, sent to every stage."""
        mean = None if self._total_loss is None else self._total_loss.detach().float() / self.micro_batches
        return mean_loss_everywhere(mean, self.grid, self.device)

    # --- the instruction loop ----------------------------------------------------------------------
    def _run(self, schedule: PipeSchedule) -> None:
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

    def _next_batch(self) -> Any:
        if self.data_iterator is None:
            raise PipelineError("no training data: pass data_iter to train_batch()/eval_batch(), call "
                                "set_dataiterator(), or give initialize() training_data")
        batch = next(self.data_iterator)
        return self.batch_fn(batch) if self.batch_fn else batch

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

    # --- instructions ------------------------------------------------------------------------------
    def _exec_load_micro_batch(self, cmd: PipeInstruction) -> None:
        chunk = getattr(cmd, "chunk", 0)
        batch = self._next_batch()
        buf = self._buffers[cmd.buffer_id]  # type: ignore[attr-defined]
        if self._is_first_virtual(chunk):
            buf.inputs = self._to_device(batch[0])
        if self._is_last_virtual(chunk):
            buf.labels = self._to_device(batch[1])

    def _exec_forward_pass(self, cmd: PipeInstruction) -> None:
        chunk = getattr(cmd, "chunk", 0)
        buf = self._buffers[cmd.buffer_id]  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        self.observer.forward_start()
        outputs = self.module(buf.inputs, chunk=chunk) if self.chunks > 1 else self.module(buf.inputs)
        self.observer.forward_end()
        if self._is_last_virtual(chunk):
            if self._compute_loss and self.module.loss_fn is not None:
                loss = self.module.loss_fn(outputs, buf.labels)
            else:
                loss = outputs
            buf.loss = loss
            if self.eval_return_logits:
                self.outputs = outputs
            if torch.is_tensor(loss):
                detached = loss.detach()
                self._total_loss = detached.clone() if self._total_loss is None else self._total_loss + detached
                self._fwd_outputs.append(detached)
            else:
                self._fwd_outputs.append([t.detach() for t in loss])
        else:
            buf.outputs = outputs
        end = time.perf_counter()
        self._stats.compute_seconds += end - t0
        self._stats.forward_seconds += end - t0
        self._stats.pipeline_seconds = end - self._batch_t0

    def _exec_backward_pass(self, cmd: PipeInstruction) -> None:
        chunk = getattr(cmd, "chunk", 0)
        buf = self._buffers[cmd.buffer_id]  # type: ignore[attr-defined]
        assert self.optimizer is not None
        reducer = self.optimizer.reducer
        t0 = time.perf_counter()
        reducer.begin_micro_step(False)  # accumulate locally; ReduceGrads communicates once per batch
        if self._is_last_virtual(chunk):
            if not torch.is_tensor(buf.loss) or buf.loss.numel() != 1:
                raise ValueError("the last stage must produce a scalar loss (set PipelineModule(loss_fn=...))")
            scaled = buf.loss.float() / self.micro_batches
            scale = self.optimizer.loss_scaler.loss_scale
            if scale != 1.0:
                scaled = scaled * scale
            self.observer.backward_start(buf.loss)
            scaled.backward()
        else:
            outs = [t for t in as_tuple(buf.outputs) if t.requires_grad]
            if len(outs) != len(buf.out_grads):
                raise PipelineError(f"stage {self.stage_id}: {len(outs)} outputs need gradients but "
                                    f"{len(buf.out_grads)} gradients arrived")
            self.observer.backward_start(torch.zeros(()))
            torch.autograd.backward(outs, buf.out_grads)
        reducer.end_micro_step()
        self.observer.backward_end()
        buf.outputs, buf.out_grads, buf.loss = None, None, None
        end = time.perf_counter()
        self._stats.compute_seconds += end - t0
        self._stats.backward_seconds += end - t0
        self._stats.pipeline_seconds = end - self._batch_t0

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
        assert self.optimizer is not None
        reducer = self.optimizer.reducer
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
        assert self.optimizer is not None
        reducer = self.optimizer.reducer
        reducer.begin_micro_step(True)
        reducer.end_micro_step()

    def _exec_optimizer_step(self, cmd: PipeInstruction) -> None:
        assert self.optimizer is not None
        self.channels.finish()  # no send may still read a buffer the step rewrites
        self.observer.step_start()
        applied = self.optimizer.step()
        self._step_applied = applied
        if applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.micro_steps += self.micro_batches
        total = self.comms.total_volume()
        self.last_step_comm_volume = total - self._comm_volume_at_step_start
        self._comm_volume_at_step_start = total
        with torch.no_grad():  # every stage learns the batch's loss: rank 0's progress line shows it, not 0
            self.agg_train_loss = self._aggregate_loss()
        self.observer.loss_sum = self.agg_train_loss
        self.observer.step_end(True)
