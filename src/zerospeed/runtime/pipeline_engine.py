"""PipelineEngine: DeepSpeed's facade over the engine's parts and one stage executor.

``train_batch()`` pulls ``gradient_accumulation_steps`` micro-batches (first stage: inputs, last stage:
labels), has the stage executor (``parallel/pipeline/executor.py``) run the schedule (1F1B, or interleaved
1F1B when the module has virtual stages: tied gradients summed, gradients reduced over the data-parallel
group with the ZeRO optimizer) and steps; it returns the batch's mean loss on every stage. The engine is the
executor's :class:`StageHost`: it hands out the next batch, the reducer, the loss scale and the step.
Per step: ``last_step_stats`` (compute, receive-wait and reduce seconds, p2p bytes).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .. import comm
from ..parallel.pipeline.accounting import PipeStepStats
from ..parallel.pipeline.channel import Channels
from ..parallel.pipeline.eager import EagerTrainSchedule
from ..parallel.pipeline.executor import StageExecutor
from ..parallel.pipeline.interleaved import InterleavedSchedule
from ..parallel.pipeline.losses import broadcast_from_last, mean_loss_everywhere, reduce_outputs
from ..parallel.pipeline.module import PipelineError, PipelineModule
from ..parallel.pipeline.schedule import InferenceSchedule, PipeSchedule, TrainSchedule
from .engine import Engine

__all__ = ["PipelineEngine", "check_pipeline_section"]


def check_pipeline_section(section: Any, module: Any) -> None:
    """The config's ``stages`` / ``partition`` / ``seed_layers`` must agree with the PipelineModule, which is
    what decides them (DeepSpeed reads none of the three and silently ignores a disagreeing value)."""
    from ..config import ConfigError

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
        from ..parallel.tensor.model_init import tp_state

        if module.mpu().get_slice_parallel_world_size() > 1 and tp_state(module) is None:
            from ..config.errors import NotSupportedYetError

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
        self.executor = StageExecutor(module, self.grid, self.channels, self.device, self)
        self.executor.micro_batches = self.micro_batches
        if self.training_dataloader is not None:
            from ..data.repeating import RepeatingLoader

            self.set_dataiterator(iter(RepeatingLoader(self.training_dataloader)))

    @property
    def last_step_stats(self) -> PipeStepStats:
        return self.executor.last_step_stats

    @property
    def outputs(self) -> Any:
        return self.executor.outputs

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
        from .dataloader import build_dataloader

        if data_sampler is not None or num_local_io_workers:
            raise NotImplementedError("deepspeed_io(data_sampler=..., num_local_io_workers=...) is not supported "
                                      "yet by zerospeed")
        return build_dataloader(dataset, batch_size or self.micro_batch_size, self.grid.get_data_parallel_rank(),
                                self.grid.get_data_parallel_world_size(), collate_fn,
                                self.config.dataloader_drop_last, seed=self.config.seed or 0)

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: bool | None = None, overwrite: bool | None = None) -> bool:
        """Collective over every rank: per-parameter (layer-indexed) state, loadable at any pipeline degree
        (the engine's save, with the pipeline stage's checkpoint part: runtime/checkpoint/parts.py)."""
        if exclude_frozen_parameters:
            raise NotImplementedError("save_checkpoint(exclude_frozen_parameters=True) of a pipeline engine "
                                      "is not supported yet by zerospeed")
        return super().save_checkpoint(save_dir, tag, client_state, save_latest, False, async_save, overwrite)

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> Any:
        """Collective over every rank: returns ``(path, client_state)`` or ``(None, None)``."""
        if custom_load_fn is not None:
            raise NotImplementedError("custom_load_fn not supported w. pipeline parallelism")
        return super().load_checkpoint(load_dir, tag, load_module_strict, load_optimizer_states,
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
        ex = self.executor
        ex.total_loss, ex.fwd_outputs, ex.compute_loss, ex.micro_batches = None, [], True, self.micro_batches
        self.agg_train_loss = None
        with comm.recording(self.comms), self.activation_checkpointing.active():  # its own logger, checkpointing
            ex.run(self._train_schedule())  # its optimizer step aggregates the loss (for the progress line too)
        if self.agg_train_loss is None:
            with torch.no_grad():
                self.agg_train_loss = self._aggregate_loss()
        return self.agg_train_loss

    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Forward ``num_micro_batches`` (default: the accumulation steps) micro-batches without gradients."""
        ex = self.executor
        ex.return_logits, ex.compute_loss, ex.fwd_outputs, ex.outputs = return_logits, compute_loss, [], None
        self.module.eval()
        saved = self.data_iterator
        self.set_dataiterator(data_iter)
        micro_batches = self.micro_batches if num_micro_batches is None else num_micro_batches
        schedule: PipeSchedule = (InterleavedSchedule(micro_batches, self.num_stages, self.stage_id, self.chunks,
                                                      forward_only=True) if self.chunks > 1
                                  else InferenceSchedule(micro_batches, self.num_stages, self.stage_id))
        with torch.no_grad(), comm.recording(self.comms), self.activation_checkpointing.active():
            ex.run(schedule)
        out: Any = None
        if self.is_last_stage():
            out = self._reduce_outputs(ex.fwd_outputs, reduce_output, micro_batches)
        if compute_loss and bcast_loss and self.is_pipe_parallel:
            out = self._bcast_from_last(out)
        self.set_dataiterator(saved)
        ex.return_logits = False
        if return_logits:
            logits, ex.outputs = ex.outputs, None
            return out, logits
        return out

    def _reduce_outputs(self, outputs: list[Any], reduce: str | None, micro_batches: int) -> Any:
        return reduce_outputs(outputs, reduce, micro_batches, self.grid)

    def _bcast_from_last(self, value: Any) -> torch.Tensor:
        return broadcast_from_last(value, self.grid)

    def _aggregate_loss(self) -> torch.Tensor:
        """Mean over micro-batches (last stage), averaged over data-parallel replicas, sent to every stage."""
        total = self.executor.total_loss
        mean = None if total is None else total.detach().float() / self.micro_batches
        return mean_loss_everywhere(mean, self.grid, self.device)

    # --- the executor's host (parallel/pipeline/executor.py: StageHost) -------------------------------
    def next_batch(self) -> Any:
        if self.data_iterator is None:
            raise PipelineError("no training data: pass data_iter to train_batch()/eval_batch(), call "
                                "set_dataiterator(), or give initialize() training_data")
        batch = next(self.data_iterator)
        return self.batch_fn(batch) if self.batch_fn else batch

    def stage_reducer(self) -> Any:
        assert self.optimizer is not None
        return self.optimizer.reducer

    def pipeline_step(self) -> None:
        """The schedule's OptimizerStep: step the ZeRO optimizer and the schedule, count, aggregate the loss."""
        assert self.optimizer is not None
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
