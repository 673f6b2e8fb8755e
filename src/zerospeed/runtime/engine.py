"""The training engine: DeepSpeed's forward / backward / step contract around a ZeRO optimizer.

The engine owns the step counters and the gradient-accumulation protocol; everything that depends
on which stage, precision or feature is on was decided in ``build.py`` and handed in.

Failures (docs/recovery.md): an exception inside ``forward``, ``backward`` or ``step`` on any rank
abandons the current optimizer step on every rank. The failing rank resets its reducer, stage-3 fetcher
and optimizer buffers and drops its connections of the engine's group (a ``comm.RecoverableGroup``),
so every peer's pending or next collective of that step fails at once; the peers reset the same way.
Each rank's next ``forward``/``backward``/``step`` rebuilds the group and checks that all ranks still
agree (same step count; no rank failed after it began changing parameters). The optimizer's commit
point is a collective before the first parameter changes, so a step that failed before it is applied
nowhere; a failure after it (inside the parameter update) leaves the engine refusing to continue.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from .. import checkpointing, comm
from ..accelerator.host_malloc import HeapTrimmer
from ..config import ZeroSpeedConfig
from ..config.batch import BatchSizes
from ..precision.cast import cast_inputs_half
from .lockstep import MicroStepCheck
from .no_sync import check_step as check_no_sync_step, no_sync_block
from .observer import StepObserver
from .parts import EngineParts
from .torch_backward import TorchBackward


class Engine(nn.Module):
    """One model's training: the parts ``initialize()`` built (``EngineParts``) driven through DeepSpeed's API."""

    def __init__(self, module: nn.Module, config: ZeroSpeedConfig, batch: BatchSizes, parts: EngineParts,
                 dp_group: comm.Group | None, device: torch.device, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self._batch = batch
        self.parts = parts
        self.optimizer = optimizer = parts.optimizer
        self.lr_scheduler, self.training_dataloader = parts.lr_scheduler, parts.training_dataloader
        self.dp_group, self.device, self.compute_dtype = dp_group, device, compute_dtype
        self.zero3, self.data_efficiency, self.fp8_modules = parts.zero3, parts.data_efficiency, parts.fp8_modules
        self.heap_trimmer: HeapTrimmer | None = parts.heap_trimmer
        self.comms, self.checkpoint_writer = parts.comms, parts.checkpoint_writer
        self.checkpoint_parts = parts.checkpoint_parts  # what save/load_checkpoint iterate (runtime/checkpoint/part.py)
        self.activation_checkpointing = parts.activation_checkpointing or checkpointing.current()
        self.compression = parts.compression  # compression_training / MoQ (compression/runtime.py) or None
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._boundary_override: bool | None = None
        self._inside_no_sync = False
        self._in_step = False  # inside step(): the boundary under managed_gradient_accumulation: false
        self._accumulating = False  # gradients accumulated since the last boundary step (checkpoints refuse them)
        self._comm_volume_at_step_start = self.comms.total_volume()
        self.last_step_comm_volume = 0
        self.last_checkpoint_stats: Any = None
        self.global_rank = comm.get_rank()
        self.local_rank = comm.get_local_rank()  # DeepSpeed's engine.local_rank (initialize() sets args.local_rank)
        self.world_size = comm.get_world_size()
        self.dp_world_size = comm.get_world_size(dp_group)
        # Sequence parallelism (DeepSpeed's names; set_sequence_groups): without it the data-parallel and the
        # sequence-data-parallel groups are both the ZeRO group.
        self.sequence_parallel_size = 1
        self.seq_parallel_group: Any = None
        self.seq_data_parallel_group = dp_group
        self.seq_dp_world_size = self.dp_world_size
        self.data_parallel_group = dp_group
        self.mpu: Any = None
        self.tensor_parallel = parts.tensor_parallel
        self.checkpoint_group = parts.checkpoint_group  # None: the data-parallel group's ranks write
        self.mp_world_size = parts.mp_world_size
        if parts.sequence_grid is not None:
            self.set_sequence_groups(parts.sequence_grid)
        self.observer = StepObserver(self, config, self.global_rank)
        self.timers = self.observer.timers
        self.backwards_in_window = 0
        self._checked_generation = 0
        self.lockstep = MicroStepCheck()  # ranks out of step between forward and backward (runtime/lockstep.py)
        # loss.backward() on the outputs, coalesce_grad_reduction(), unmanaged accumulation (runtime/torch_backward.py)
        self.torch_backward = TorchBackward(self, config.managed_gradient_accumulation)
        self.broken: str | None = None  # why the engine refuses to continue (ranks may disagree on weights)
        self._is_compiled = False
        self.deepcompiled: Any = None  # runtime/deepcompile.DeepCompiled after engine.compile() with DeepCompile
        if optimizer is not None:
            from ..zero import fragments

            fragments.bind(optimizer)  # zerospeed.utils.safe_get_full_fp32_param & co. find each parameter's shard
        from .autotuning_probe import AutotuningProbe

        self._autotuning = AutotuningProbe.create(config)  # an autotuning experiment: profile, report, end

    def __getattr__(self, name: str) -> Any:
        """As DeepSpeed: a name the engine lacks is looked up on the wrapped module (``engine.generate()``,
        a model's own methods and attributes); the engine's own names, and nn.Module's, win."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            try:
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}' (nor has its "
                                     f"module, {type(module).__name__})") from None

    @property
    def tput_timer(self) -> Any:
        """DeepSpeed's throughput timer (``avg_samples_per_sec()``, ``global_step_count``), fed each step."""
        return self.observer.tput_timer

    # --- batch-size accessors (DeepSpeed names) ---------------------------------------------------
    def train_batch_size(self) -> int:
        return self._batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._batch.micro_batch_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._batch.gradient_accumulation_steps

    def set_sequence_groups(self, grid: Any) -> None:
        """Sequence parallelism (``parallel/sequence/groups.py``): ``dp_group`` stays ZeRO's group over every
        rank (``seq_data_parallel_group``); ``data_parallel_group``/``dp_world_size`` count replicas."""
        self.mpu = grid
        self.sequence_parallel_size = grid.get_sequence_parallel_world_size()
        self.seq_parallel_group = grid.get_sequence_parallel_group()
        self.data_parallel_group = grid.get_data_parallel_group()
        self.dp_world_size = grid.get_data_parallel_world_size()

    def get_sequence_parallel_group(self) -> Any:
        return self.seq_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.mpu.get_data_parallel_rank() if self.mpu is not None else comm.get_rank(self.dp_group)

    def zero_optimization_stage(self) -> int:
        return self.config.zero_stage

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def torch_autocast_enabled(self) -> bool:
        return self.config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> torch.dtype | None:
        return None if self.parts.autocast is None else self.parts.autocast.dtype

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        return [] if self.parts.autocast is None else self.parts.autocast.safe_module_names

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    @property
    def accumulating(self) -> bool:
        """Gradients accumulated since the last boundary step (a checkpoint refuses to drop them)."""
        return self._accumulating

    def is_gradient_accumulation_boundary(self) -> bool:
        """True on the micro-step that ends an accumulation (or as set by ``set_gradient_accumulation_boundary``)."""
        if not self.torch_backward.managed:  # the caller's boundary: step() (DeepSpeed's unmanaged mode)
            return self._in_step
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Let the caller decide where accumulation ends (DeepSpeed's hook for frameworks that count
        micro-steps themselves); ``None`` returns to counting ``gradient_accumulation_steps``."""
        if not self.torch_backward.managed:
            raise RuntimeError("set_gradient_accumulation_boundary() is not supported with managed_gradient_"
                               "accumulation: false (the caller owns the boundary by calling step())")
        self._boundary_override = None if is_boundary is None else bool(is_boundary)

    def no_sync(self) -> Any:
        """Backward passes inside accumulate gradients locally without communicating (stages 0-1; no_sync.py)."""
        return no_sync_block(self)

    def zero_grad(self) -> None:
        """Drop the gradients accumulated so far (the optimizer step does this by itself), and, as DeepSpeed
        does, every ``p.grad`` of the module (gradients another engine's backward left there)."""
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        self._accumulating = False
        for p in self.module.parameters():
            p.grad = None

    # --- failures (docs/recovery.md) ----------------------------------------------------------------
    @contextmanager
    def _guarded(self, what: str) -> Iterator[None]:
        """Run one engine call; on an exception abandon the step on every rank and re-raise."""
        self._ensure_usable()
        try:
            # this engine's collectives count in its own logger; its activation checkpointing is the current one
            with comm.recording(self.comms), self.activation_checkpointing.active():
                yield
        except Exception as exc:
            self._abandon_step(what, exc)
            raise

    def _ensure_usable(self) -> None:
        if self.broken == "destroyed":
            raise RuntimeError("this engine was destroyed (engine.destroy()); build a new one with zerospeed.initialize()")
        if self.broken is not None:
            raise RuntimeError(f"the engine cannot continue, its state may be inconsistent across ranks: "
                               f"{self.broken}. Reload a checkpoint (engine.load_checkpoint) into a new engine")
        group = self.dp_group
        if not isinstance(group, comm.RecoverableGroup) or (group.generation == self._checked_generation
                                                            and not group.dropped):
            return
        group.pg  # noqa: B018 - rebuilds a dropped group (every rank that abandoned the step gets here)
        self._checked_generation = group.generation
        flags = torch.tensor([float(self.global_steps), -float(self.global_steps)],
                             device=comm.device_for_backend(group))
        comm.all_reduce(flags, group=group, op=comm.ReduceOp.MAX)
        if flags[0] != -flags[1]:
            self.broken = (f"after a failed step the ranks disagree on the number of optimizer steps applied "
                           f"(between {int(-flags[1])} and {int(flags[0])}; this rank {self.global_steps})")
            raise RuntimeError(f"the engine cannot continue, its state is inconsistent across ranks: {self.broken}. "
                               "Reload a checkpoint")

    def _abandon_step(self, what: str, exc: BaseException) -> None:
        """Reset what the failed step left behind and drop this rank's connections (peers fail at once)."""
        updating = self.optimizer is not None and getattr(self.optimizer, "updating", False)
        if updating:
            self.broken = (f"an exception in engine.{what}() while the optimizer was updating parameters "
                           f"({type(exc).__name__}: {exc}); ranks may now hold different weights")
        # Let go of collectives in flight, drop the connections (which waits until the backend is done with
        # those collectives' buffers; peers fail at once), and only then zero the gradient buffers.
        if self.optimizer is not None:
            self.optimizer.reducer.release_in_flight()
        if self.zero3 is not None:
            self.zero3.fetcher.reset()
        if isinstance(self.dp_group, comm.RecoverableGroup) and self.seq_dp_world_size > 1:
            self.dp_group.drop()
        if self.optimizer is not None:
            self.optimizer.abandon_step()
        for name in self.timers.names():
            if self.timers(name).running:
                self.timers(name).stop()
        gas = self.gradient_accumulation_steps()
        self.micro_steps -= self.micro_steps % gas  # the whole accumulation window is abandoned
        self.backwards_in_window = 0
        self._accumulating = False
        self.lockstep.reset()
        if hasattr(exc, "add_note"):
            exc.add_note(f"zerospeed: rank {self.global_rank} abandoned optimizer step {self.global_steps + 1} "
                         f"(engine.{what}() raised); every rank abandons it and rebuilds its connections at "
                         "the next forward/backward/step. Catch the error around the whole step and continue "
                         "with the next batch." if self.broken is None else f"zerospeed: {self.broken}")

    # --- hybrid engine: rollouts between training steps (runtime/hybrid_engine.py) -----------------
    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module's ``generate``; with ``hybrid_engine`` on, in a rollout phase (gathered weights, KV cache)."""
        if self.parts.hybrid is None:
            return self.module.generate(*inputs, **kwargs)
        with self._guarded("generate"):
            return self.parts.hybrid.generate(*inputs, **kwargs)

    def train(self, mode: bool = True) -> "Engine":
        """nn.Module's ``train``; ``train()`` also ends a rollout phase (``eval()`` starts one)."""
        super().train(mode)
        if mode and self.__dict__.get("parts") is not None and self.parts.hybrid is not None:
            self.parts.hybrid.end_phase()
        return self

    # --- forward / backward / step ----------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with self._guarded("forward"):
            self.observer.forward_start()
            if self.config.fp16.auto_cast:
                inputs = cast_inputs_half(inputs)
            if self.data_efficiency is not None:  # curriculum_seqlen=, progressive_layer_drop=, pld_theta=
                kwargs = {**kwargs, **self.data_efficiency.forward_kwargs(self.module.training, self.global_steps)}
            self.lockstep.forward_seen(self.module)
            if self.compression is not None:
                self.compression.before_forward()
            with self._autocast():
                out = self.torch_backward.watch(self.module(*inputs, **kwargs))
            self.observer.forward_end()
        return out

    def _autocast(self) -> Any:
        """torch_autocast's region around the module's forward (precision/autocast.py); DeepSpeed's nesting rules."""
        region = self.parts.autocast
        return nullcontext() if region is None else region.region()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss`` (divided by the accumulation steps, times the fp16 loss scale); returns, as
        DeepSpeed does, the loss divided by the accumulation steps (``scale_wrt_gas``), without the loss scale."""
        if self.optimizer is None:
            raise RuntimeError("engine.backward() needs an optimizer: set 'optimizer' in the config or pass one")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError("engine.backward(loss) expects a scalar loss tensor")
        scaled = loss.float() * self.torch_backward.loss_factor(scale_wrt_gas)
        with self._guarded("backward"):
            self.torch_backward.begin(loss)  # the micro-step protocol, shared with loss.backward()
            if self.compression is not None:  # MoQ's eigenvalues differentiate the loss first
                self.compression.on_backward(loss, self.is_gradient_accumulation_boundary())
            with self.torch_backward.engine_pass(scaled):  # other engines' output hooks stand aside
                scaled.backward(retain_graph=retain_graph)
            self.torch_backward.end()
        gas = self.gradient_accumulation_steps()
        return loss / gas if scale_wrt_gas else loss

    def _backward_epilogue(self) -> None:
        """DeepSpeed's: after ``loss.backward()`` through ``engine.module`` (runtime/torch_backward.py), take the
        gradients it left in ``p.grad`` as one micro-step."""
        self.torch_backward.take_left_grads()

    def coalesce_grad_reduction(self) -> Any:
        """DeepSpeed's context manager: the backward calls inside are reduced once, at its exit."""
        return self.torch_backward.coalesce()

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Advance one micro-step; at the accumulation boundary apply the optimizer and the schedule."""
        if self.optimizer is None:
            raise RuntimeError("engine.step() needs an optimizer: set 'optimizer' in the config or pass one")
        boundary = self.is_gradient_accumulation_boundary()
        check_no_sync_step(self)
        if self.parts.hybrid is not None:  # weights held for rollouts go back to their shards before they change
            self.parts.hybrid.end_phase()
        self.torch_backward.check_step()
        with self._guarded("step"):
            self.torch_backward.before_step()
            self._in_step = True
            try:
                self._step(boundary or not self.torch_backward.managed, lr_kwargs)
            finally:
                self._in_step = False
        if self._autotuning is not None:
            self._autotuning.after_step(self)

    def _step(self, boundary: bool, lr_kwargs: dict[str, Any] | None) -> None:
        assert self.optimizer is not None
        self.observer.step_start()
        if boundary and self.backwards_in_window == 0 and any(p.grad is not None for p in self.module.parameters()):
            raise RuntimeError("engine.step() found gradients in p.grad but engine.backward() was not called in "
                               "this step: call engine.backward(loss), or engine._backward_epilogue() after a loss.backward() "
                               "that bypassed engine(...) (gradients from another engine's backward stay in "
                               "p.grad; clear them with zero_grad())")
        if boundary:
            self.backwards_in_window = 0
            if self.data_efficiency is not None:
                self.data_efficiency.on_step_boundary(self.global_steps)
            applied = self.optimizer.step()
            if self.compression is not None:
                self.compression.after_step(applied)
            self._accumulating = False
            self._step_applied = applied
            if applied:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            else:
                self.skipped_steps += 1
            self.global_steps += 1
            self.global_samples += self.torch_backward.samples(self.train_batch_size(), self.gradient_accumulation_steps())
            # Everything since the previous boundary: the step's forwards (stage-3 gathers), backwards, update.
            total = self.comms.total_volume()
            self.last_step_comm_volume = total - self._comm_volume_at_step_start
            self._comm_volume_at_step_start = total
        self.observer.step_end(boundary)
        self.micro_steps += 1

    def compile(self, backend: Any = None, compile_kwargs: dict[str, Any] | None = None,  # type: ignore[override]
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's ``engine.compile``: ``torch.compile`` the model in place (``backend`` None: the
        accelerator's, inductor) under any ZeRO stage, or DeepCompile (``runtime/compile.py``); once only."""
        from .compile import compile_engine_module

        self._ensure_usable()
        if self._is_compiled:
            return
        self.deepcompiled = compile_engine_module(self.module, self.config.compile, self.zero3, self.optimizer, backend,
                                                  {} if compile_kwargs is None else compile_kwargs, schedule,
                                                  compiled_autograd_enabled)
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled

    def was_step_applied(self) -> bool:
        return self._step_applied

    # --- data efficiency (data_pipeline/; DeepSpeed's names) ------------------------------------------
    def get_pld_theta(self) -> float | None:
        pld = getattr(self.data_efficiency, "progressive_layer_drop", None)
        return None if pld is None else pld.get_theta()

    def pld_enabled(self) -> bool:
        return self.config.progressive_layer_drop.enabled

    def curriculum_enabled_legacy(self) -> bool:
        return self.config.curriculum_learning.enabled

    def curriculum_learning_enabled(self) -> bool:
        return self.config.data_efficiency.data_sampling.curriculum_learning.enabled

    def random_ltd_enabled(self) -> bool:
        return self.config.data_efficiency.data_routing.random_ltd.enabled

    @property
    def curriculum_scheduler_legacy(self) -> Any:
        return getattr(self.data_efficiency, "curriculum_scheduler_legacy", None)

    @property
    def random_ltd_scheduler(self) -> Any:
        return getattr(self.data_efficiency, "random_ltd_scheduler", None)

    def random_ltd_initialize(self) -> None:
        """Configure the ``RandomLayerTokenDrop`` layers of ``random_ltd_layer_id`` (``convert_to_random_ltd``)."""
        if self.random_ltd_scheduler is None:
            raise ValueError("random_ltd_initialize() needs data_efficiency.data_routing.random_ltd.enabled: true")
        from ..data_pipeline.random_ltd import init_random_ltd_layers

        init_random_ltd_layers(self.module, self.data_efficiency.random_ltd_config, self.random_ltd_scheduler)

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: dict[str, Any]) -> None:
        """``{metric: fn(step) -> difficulty}`` for the curriculum sampler's metrics of schedule_type custom."""
        sampler = getattr(self.training_dataloader, "data_sampler", None)
        if sampler is not None and hasattr(sampler, "set_custom_curriculum_learning_schedule"):
            sampler.set_custom_curriculum_learning_schedule(schedule_func_dict)

    # --- state queries ----------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        if self.optimizer is None:
            return []
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        if self.optimizer is None:
            return []
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return None if self.optimizer is None else self.optimizer.global_grad_norm

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.optimizer is None else self.optimizer.loss_scale

    @property
    def cur_scale(self) -> float:
        return self.loss_scale

    def memory_breakdown(self) -> dict[str, int]:
        """Accounting, not measurement: bytes of persistent model state held by this rank, by kind.

        Transient memory (activations, gathered ZeRO-3 parameters, communication buckets, temporaries) is not
        in it; :meth:`measured_memory` gives the measured peak of the last step."""
        params = (self.zero3.param_bytes() if self.zero3 is not None
                  else sum(p.numel() * p.element_size() for p in self.module.parameters()))
        buffers = sum(b.numel() * b.element_size() for b in self.module.buffers())
        grads = self.optimizer.reducer.grad_bytes() if self.optimizer else 0
        master = self.optimizer.master_bytes() if self.optimizer else 0
        state = self.optimizer.optimizer_state_bytes() if self.optimizer else 0
        out = {"params": params, "grads": grads, "master": master, "optimizer_state": state, "buffers": buffers}
        out["model_states"] = params + grads + master + state
        out["total"] = out["model_states"] + buffers
        return out

    def measured_memory(self) -> dict[str, Any] | None:
        """Measured peak of the last optimizer step, transient buffers included (CUDA allocator peak, or peak
        process RSS on CPU), with the usage at the step's start; None unless ``memory_breakdown`` is on."""
        meter = self.observer.memory_meter
        return None if meter is None or meter.last is None else meter.last.as_dict()

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def comms_summary(self) -> str:
        return self.comms.summary(self.dp_world_size)

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: release ZeRO-3's gathered parameters nothing is using (a no-op below stage 3)."""
        if self.zero3 is not None:
            self.zero3.empty_partition_cache()

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Collective: the whole model in its compute dtype, as safetensors on rank 0 (True there).

        Under stage 3 this gathers the partitioned parameters, so it needs
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save: true`` as in DeepSpeed; experts and
        tensor-parallel shards are joined (``runtime/export_model.py``).
        """
        return self.parts.model_export(self.module, save_dir, save_filename, exclude_frozen_parameters)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """Collective: the whole model in its compute dtype on rank 0 (``{}`` elsewhere), under any stage."""
        from ..zero.stage3 import full_state_dict

        state = full_state_dict(self.module, rank0_only=True, group=self.dp_group)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def destroy(self) -> None:
        """Finish pending checkpoint writes and detach the engine from the module (hooks removed, monitors
        closed, the engine's own process group closed); the engine refuses further use. The world process
        group stays up (``zerospeed.comm.destroy``)."""
        if self.broken == "destroyed":
            return
        self.wait_for_checkpoint()
        if self.optimizer is not None:
            self.optimizer.reducer.remove_hooks()
        if self.zero3 is not None:
            self.zero3.remove_hooks()
        self.observer.close()
        from .teardown import close_own_groups

        close_own_groups(self)  # the engine's own connections and their native threads (runtime/teardown.py)
        self.broken = "destroyed"

    # --- checkpoints (runtime/checkpoint/) ---------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: bool | None = None, overwrite: bool | None = None) -> bool:
        """Collective: write a universal checkpoint atomically (``async_save`` defaults to the config's;
        ``overwrite``: docs/checkpointing.md, "Existing tags")."""
        from .checkpoint import save_checkpoint
        from .checkpoint.tiered import background_writes

        if not save_dir:  # DeepSpeed's ValueError (a None would otherwise fail deep inside os.path)
            raise ValueError(f"save_checkpoint(save_dir) needs a non-empty directory path, got {save_dir!r}")
        if self.zero3 is not None:
            self.zero3.check_checkpointable()  # MiCS: refused by name before anything is written

        use_async = background_writes(self.config) if async_save is None else async_save
        self.last_checkpoint_stats = save_checkpoint(self, save_dir, tag, client_state, save_latest, use_async,
                                                     self.config.comms_timeout_s, exclude_frozen_parameters,
                                                     overwrite)
        return True

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, Any]:
        """Collective: returns ``(path, client_state)``, or ``(None, None)`` when there is no checkpoint."""
        from .checkpoint import load_checkpoint

        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...) is not supported yet by zerospeed")
        return load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only)

    def wait_for_checkpoint(self) -> None:
        """Block until an async save has been written and committed (re-raises its error)."""
        from .checkpoint import wait_for_checkpoint

        wait_for_checkpoint(self)


DeepSpeedEngine = Engine  # DeepSpeed's class name: isinstance checks in scripts and frameworks
