"""Render a forward profile as text: summary (with throughput and MFU), top modules per depth, module tree."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ...zero.stage3.param_store import shard_of
from .counter import ModuleStats
from .peaks import mfu, peak_flops
from .units import (
    DEFAULT_PRECISION,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

LINE = "{:<70}  {:<8}"


@dataclass
class StepTimes:
    """Whole-step latencies in seconds from the engine's timers (None when not measured)."""

    forward: float | None = None
    backward: float | None = None
    step: float | None = None


@dataclass
class RunInfo:
    """What the engine knows about the run; every field optional for standalone use."""

    world_size: int | None = None
    dp_world_size: int | None = None
    mp_world_size: int = 1
    micro_batch_size: int | None = None
    times: StepTimes = field(default_factory=StepTimes)
    device_name: str = "cpu"


def full_numel(param: torch.Tensor) -> int:
    """A parameter's full size: under ZeRO-3 its data is a placeholder and the shard state knows the size."""
    shard = shard_of(param)
    return shard.numel if shard is not None else param.numel()


def module_params(module: nn.Module) -> int:
    """Parameters of ``module`` and its children, each counted once, at full size (as DeepSpeed counts)."""
    return sum(full_numel(p) for p in module.parameters())


def _pct(part: float, whole: float) -> float:
    return round(100 * part / whole, DEFAULT_PRECISION) if whole else 0.0


def summary_lines(
    stats: ModuleStats, params: int, step: int, info: RunInfo, recompute_fwd_factor: float
) -> list[str]:
    out = [f"Profile Summary at step {step}:"]
    for label, value in [
        ("world size: ", info.world_size),
        ("data parallel size: ", info.dp_world_size),
        ("model parallel size: ", info.mp_world_size if info.world_size is not None else None),
        ("batch size per GPU: ", info.micro_batch_size),
    ]:
        if value is not None:
            out.append(LINE.format(label, value))
    mp = info.mp_world_size
    out += [
        LINE.format("params per GPU: ", params_to_string(params)),
        LINE.format("params of model = params per GPU * mp_size: ", params_to_string(params * mp)),
        LINE.format("fwd MACs per GPU: ", macs_to_string(stats.macs)),
        LINE.format("fwd flops per GPU: ", number_to_string(stats.flops)),
        LINE.format("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(stats.flops * mp)),
    ]
    fwd = info.times.forward if info.times.forward is not None else stats.duration
    achieved = stats.flops / fwd if fwd else 0.0
    out.append(LINE.format("fwd latency: ", duration_to_string(fwd)))
    out.append(LINE.format("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", flops_to_string(achieved)))
    bwd, step_s = info.times.backward, info.times.step
    if bwd is not None and step_s is not None:
        factor = 2 + recompute_fwd_factor
        iter_s = fwd + bwd + step_s
        achieved = (factor + 1) * stats.flops / iter_s if iter_s else 0.0
        out += [
            LINE.format("bwd latency: ", duration_to_string(bwd)),
            LINE.format(
                f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
                flops_to_string(factor * stats.flops / bwd if bwd else 0.0),
            ),
            LINE.format(
                f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
                flops_to_string((factor + 1) * stats.flops / (fwd + bwd) if fwd + bwd else 0.0),
            ),
            LINE.format("step latency: ", duration_to_string(step_s)),
            LINE.format("iter latency: ", duration_to_string(iter_s)),
            LINE.format(
                f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ", flops_to_string(achieved)
            ),
        ]
        if info.micro_batch_size is not None and info.world_size is not None and iter_s:
            samples = info.micro_batch_size * info.world_size / iter_s
            out.append(LINE.format("samples/second: ", round(samples, DEFAULT_PRECISION)))
    out.append(mfu_line(achieved, info.device_name))
    return out


def mfu_line(achieved: float, device_name: str) -> str:
    ratio = mfu(achieved, device_name)
    if ratio is None:
        return LINE.format("MFU: ", f"n/a (no known peak FLOPS for '{device_name}')")
    peak = peak_flops(device_name) or 0.0
    return LINE.format(f"MFU = FLOPS per GPU / {flops_to_string(peak)} peak: ", f"{100 * ratio:.2f}%")


def aggregated_lines(
    root: nn.Module, stats: Callable[[nn.Module], ModuleStats], module_depth: int, top_modules: int
) -> list[str]:
    """Top ``top_modules`` module classes by params, MACs and latency at each depth (DeepSpeed's layout)."""
    per_depth: dict[int, dict[str, list[float]]] = {}

    def walk(module: nn.Module, depth: int) -> None:
        row = per_depth.setdefault(depth, {}).setdefault(type(module).__name__, [0, 0, 0.0])
        s = stats(module)
        row[0] += module_params(module)
        row[1] += s.macs
        row[2] += s.duration
        for child in module.children():
            walk(child, depth + 1)

    walk(root, 0)
    last = max(per_depth) if module_depth < 0 else min(module_depth, max(per_depth))
    out = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in range(last + 1):
        rows = per_depth[depth]

        def top(i: int, fmt: Callable[[float], str]) -> dict[str, str]:
            ranked = sorted(rows.items(), key=lambda kv: kv[1][i], reverse=True)[:top_modules]
            return {name: fmt(v[i]) for name, v in ranked}

        out += [
            f"depth {depth}:",
            f"    params      - {top(0, params_to_string)}",
            f"    MACs        - {top(1, macs_to_string)}",
            f"    fwd latency - {top(2, duration_to_string)}",
        ]
    return out


def detailed_lines(root: nn.Module, stats: Callable[[nn.Module], ModuleStats]) -> list[str]:
    """The module tree, each module followed by params, MACs, latency (with shares of the total) and FLOPS."""
    total = stats(root)
    total_params = module_params(root)

    def describe(module: nn.Module) -> str:
        s = stats(module)
        params = module_params(module)
        items = [
            f"{params_to_string(params)} = {_pct(params, total_params):g}% Params",
            f"{macs_to_string(s.macs)} = {_pct(s.macs, total.macs):g}% MACs",
            f"{duration_to_string(s.duration)} = {_pct(s.duration, total.duration):g}% latency",
            flops_to_string(s.flops / s.duration if s.duration else 0.0),
        ]
        extra = module.extra_repr()
        return ", ".join([*items, extra] if extra else items)

    out: list[str] = []

    def walk(module: nn.Module, name: str, indent: int) -> None:
        prefix = "  " * indent + (f"({name}): " if name else "")
        children = list(module.named_children())
        if not children:
            out.append(f"{prefix}{type(module).__name__}({describe(module)})")
            return
        out.append(f"{prefix}{type(module).__name__}(")
        out.append("  " * (indent + 1) + describe(module))
        for child_name, child in children:
            walk(child, child_name, indent + 1)
        out.append("  " * indent + ")")

    walk(root, "", 0)
    return out


def render(
    root: nn.Module,
    stats: Callable[[nn.Module], ModuleStats],
    *,
    step: int,
    info: RunInfo,
    recompute_fwd_factor: float,
    module_depth: int,
    top_modules: int,
    detailed: bool,
) -> str:
    out = ["", "-------------------------- zerospeed Flops Profiler --------------------------"]
    out += summary_lines(stats(root), module_params(root), step, info, recompute_fwd_factor)
    out += ["", "----------------------------- Aggregated Profile per GPU -----------------------------"]
    out += aggregated_lines(root, stats, module_depth, top_modules)
    if detailed:
        out += [
            "",
            "------------------------------ Detailed Profile per GPU ------------------------------",
            "Each module profile is listed after its name in the following order:",
            "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
            "percentage of total fwd latency, fwd FLOPS",
            "Note: a module's numbers include its children; operators a module runs outside any submodule "
            "make up the difference between a parent and the sum of its children.",
        ]
        out += detailed_lines(root, stats)
    out.append("------------------------------------------------------------------------------")
    return "\n".join(out)
