"""An autotuning experiment inside the engine: profile steps ``[start_profile_step, end_profile_step)``, write
the metrics where the autotuner asked, and end the run (every rank, cleanly), as DeepSpeed's engine does.

Metrics (JSON): ``latency`` (seconds per optimizer step), ``throughput`` (samples per second, all ranks),
``flops`` (model FLOPs per second when the flops profiler counted them, else null). With
``autotuning.model_info.profile`` the run ends right after ``initialize`` with the parameter counts instead.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from .. import comm
from ..accelerator import get_accelerator


def _write(path: str, obj: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _end_run() -> None:
    comm.barrier()
    comm.destroy()
    raise SystemExit(0)


class AutotuningProbe:
    def __init__(self, start: int, end: int, metric_path: str) -> None:
        self.start, self.end, self.metric_path = start, end, metric_path
        self.t0 = 0.0
        self.samples0 = 0

    @classmethod
    def create(cls, config: Any) -> AutotuningProbe | None:
        at = config.autotuning
        if not at.enabled or at.metric_path is None:
            return None
        return cls(at.start_profile_step, at.end_profile_step, at.metric_path)

    def after_step(self, engine: Any) -> None:
        """Called after every ``engine.step()``; acts on the boundaries that start and end the profile."""
        if engine.micro_steps % engine.gradient_accumulation_steps():
            return
        if engine.global_steps == self.start:
            get_accelerator().synchronize()
            self.t0, self.samples0 = time.perf_counter(), engine.global_samples
        elif engine.global_steps == self.end:
            get_accelerator().synchronize()
            elapsed = time.perf_counter() - self.t0
            steps = self.end - self.start
            flops = getattr(engine, "flops_per_step", None)
            metrics = {"latency": elapsed / steps, "throughput": (engine.global_samples - self.samples0) / elapsed,
                       "flops": None if flops is None else flops * steps / elapsed, "steps": steps}
            if comm.get_rank() == 0:
                _write(self.metric_path, metrics)
            _end_run()


def profile_model_info(config: Any, module: Any) -> None:
    """``autotuning.model_info.profile``: write the parameter counts and end the run."""
    at = config.autotuning
    if not (at.enabled and at.model_info.profile):
        return
    path = at.model_info_path or os.path.join(at.results_dir, "model_info.json")
    params = {id(p): p for p in module.parameters()}.values()
    info = {"num_params": sum(p.numel() for p in params),
            "trainable_num_params": sum(p.numel() for p in params if p.requires_grad)}
    if comm.get_rank() == 0:
        _write(path, info)
    _end_run()
