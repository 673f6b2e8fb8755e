"""``FlopsProfiler`` and ``get_model_profile``: DeepSpeed's flops-profiler API over our operator counter.

Standalone::

    prof = FlopsProfiler(model)
    prof.start_profile()
    model(batch)
    prof.stop_profile()                    # stop counting; numbers stay readable
    prof.print_model_profile(profile_step=1)
    prof.end_profile()                     # drop hooks and numbers

In the engine, :meth:`FlopsProfiler.on_forward_start`, :meth:`on_forward_end` and :meth:`on_step_end` do the
same at ``flops_profiler.profile_step``, reading fwd/bwd/step latencies from the engine's timers.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ...config.monitoring import FlopsProfilerConfig
from .._device import device_name
from .counter import FlopCounter, ModuleStats
from .report import RunInfo, StepTimes, module_params, render
from .units import duration_to_string, macs_to_string, number_to_string, params_to_string


def _engine_info(engine: Any) -> RunInfo:
    """Read the few facts the report needs from an engine-like object; every attribute is optional."""
    info = RunInfo(device_name=device_name())
    if engine is None:
        return info

    def value(name: str) -> Any:
        attr = getattr(engine, name, None)
        return attr() if callable(attr) else attr

    info.world_size = value("world_size")
    info.dp_world_size = value("dp_world_size")
    info.mp_world_size = value("mp_world_size") or 1
    info.micro_batch_size = value("train_micro_batch_size_per_gpu")
    timers = getattr(engine, "timers", None)
    if value("wall_clock_breakdown") and timers is not None:
        def seconds(name: str) -> float | None:
            return timers(name).elapsed(reset=False) / 1000.0 if timers.has(name) else None

        info.times = StepTimes(seconds("forward"), seconds("backward"), seconds("step"))
    return info


class FlopsProfiler:
    """Measures params, MACs, FLOPs and latency of each module of ``model`` during profiled forwards.

    The arguments are DeepSpeed's, positional as there: ``FlopsProfiler(model, ds_engine,
    recompute_fwd_factor)``. Counts follow DeepSpeed's conventions exactly (see :mod:`.rules`).

    Args:
        model: the module to profile (its forward is counted, children included).
        ds_engine: optional engine-like object giving world sizes, micro-batch size and ``timers`` (with
            ``wall_clock_breakdown()``), for whole-step throughput in the report.
        recompute_fwd_factor: the share of the forward that activation checkpointing recomputes in backward
            (a training step is ``3 + factor`` forward FLOPs).
        config: the ``flops_profiler`` config section (profile step, depth, output file) for the engine hooks;
            keyword only. When given and ``recompute_fwd_factor`` is left at 0, the section's factor is used.
    """

    def __init__(
        self,
        model: nn.Module,
        ds_engine: Any = None,
        recompute_fwd_factor: float = 0.0,
        *,
        config: FlopsProfilerConfig | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"FlopsProfiler needs a torch.nn.Module, got {type(model).__name__}")
        if isinstance(ds_engine, FlopsProfilerConfig):
            raise ValueError("FlopsProfiler(model, ds_engine, recompute_fwd_factor): pass the config section "
                             "as config=...")
        self.model = model
        self.config = config or FlopsProfilerConfig()
        self.ds_engine = ds_engine
        factor = recompute_fwd_factor or self.config.recompute_fwd_factor
        if factor < 0:
            raise ValueError(f"recompute_fwd_factor must be >= 0, got {factor}")
        self.recompute_fwd_factor = float(factor)
        self.started = False
        self._counter: FlopCounter | None = None
        self.flops: float = 0
        self.macs: float = 0
        self.params = 0

    # --- DeepSpeed API --------------------------------------------------------------------------------
    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Reset the numbers and start counting every forward of the model.

        Modules whose type is in ``ignore_list`` get no figures of their own; as in DeepSpeed, the
        functions they call still count for their parent (totals do not change).
        """
        if self._counter is not None:
            self._counter.detach()
        self._counter = FlopCounter(self.model, tuple(ignore_list or ()))
        self._counter.attach()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting (hooks removed); the numbers stay readable until :meth:`end_profile`."""
        if self._counter is not None:
            self._counter.detach()

    def reset_profile(self) -> None:
        if self._counter is not None:
            self._counter.reset()

    def end_profile(self) -> None:
        """Stop and forget the profile."""
        self.stop_profile()
        self._counter = None
        self.started = False

    def _stats(self, module: nn.Module) -> ModuleStats:
        if self._counter is None:
            return ModuleStats()
        return self._counter.stats(module)

    def get_total_flops(self, as_string: bool = False) -> float | str:
        flops = self._stats(self.model).flops
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> float | str:
        macs = self._stats(self.model).macs
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters of the model, each counted once (under ZeRO-3 the full sizes, not the placeholders)."""
        params = module_params(self.model)
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds spent in the model's forward while profiling."""
        seconds = self._stats(self.model).duration
        return duration_to_string(seconds) if as_string else seconds

    def module_stats(self, module: nn.Module) -> ModuleStats:
        """Counts of one submodule (children included)."""
        return self._stats(module)

    def step_flops(self) -> float:
        """FLOPs of one training step on this rank: forward * (3 + recompute_fwd_factor)."""
        return self._stats(self.model).flops * (3 + self.recompute_fwd_factor)

    def profile_string(
        self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1, detailed: bool = True
    ) -> str:
        if top_modules < 1:
            raise ValueError(f"top_modules must be >= 1, got {top_modules}")
        return render(
            self.model,
            self._stats,
            step=profile_step,
            info=_engine_info(self.ds_engine),
            recompute_fwd_factor=self.recompute_fwd_factor,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
        )

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> None:
        """Print the profile to stdout, or write it to ``output_file`` (its folder is created)."""
        if not self.started:
            return
        self.flops = self._stats(self.model).flops
        self.macs = self._stats(self.model).macs
        self.params = module_params(self.model)
        text = self.profile_string(profile_step, module_depth, top_modules, detailed)
        if output_file:
            folder = os.path.dirname(os.path.abspath(output_file))
            os.makedirs(folder, exist_ok=True)
            with open(output_file, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        else:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    # --- engine hooks (three calls per step) -----------------------------------------------------------
    def on_forward_start(self, global_step: int) -> None:
        """Engine: call before the model forward; starts counting at ``config.profile_step``."""
        if self.config.enabled and global_step == self.config.profile_step:
            self.start_profile()

    def on_forward_end(self) -> None:
        """Engine: call after the model forward; stops counting so backward/eval forwards are not added."""
        if self.started:
            self.stop_profile()

    def on_step_end(self, global_step: int) -> None:
        """Engine: call after the optimizer step (timers stopped); prints the profile once and ends it."""
        if self.started and global_step == self.config.profile_step:
            cfg = self.config
            self.print_model_profile(global_step, cfg.module_depth, cfg.top_modules, cfg.detailed, cfg.output_file)
            self.end_profile()


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Sequence[type] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
    """Profile one forward of ``model``; returns ``(flops, macs, params)`` (DeepSpeed-compatible).

    The input is ``args``/``kwargs``, or with ``input_shape`` a single tensor of that shape (the model's
    dtype and device). ``warm_up`` forwards run first, uncounted. With ``as_string`` the numbers come back
    as DeepSpeed formats them: ``('1.2 G', '602 MMACs', '1.3 M')``. ``mode='generate'`` profiles
    ``model.generate`` instead of ``forward``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"get_model_profile needs a torch.nn.Module, got {type(model).__name__}")
    kwargs = dict(kwargs or {})
    call_args = list(args)
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"input_shape must be a non-empty tuple, got {input_shape!r}")
        ref = next(model.parameters(), None)
        dtype = ref.dtype if ref is not None else torch.float32
        device = ref.device if ref is not None else torch.device("cpu")
        call_args = [torch.ones(input_shape, dtype=dtype, device=device)]
    if not call_args and not kwargs:
        raise ValueError("get_model_profile needs input_shape, args or kwargs to run the model")
    if mode not in ("forward", "generate"):
        raise ValueError(f"mode must be 'forward' or 'generate', got {mode!r}")
    run = model.generate if mode == "generate" else model  # type: ignore[operator]

    was_training = model.training
    model.eval()
    prof = FlopsProfiler(model)
    try:
        with torch.no_grad():
            for _ in range(warm_up):
                run(*call_args, **kwargs)
            prof.start_profile(ignore_list=ignore_modules)
            run(*call_args, **kwargs)
        prof.stop_profile()
    finally:
        model.train(was_training)  # profiling must not leave a training model in eval mode
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(warm_up, module_depth, top_modules, detailed, output_file)
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
