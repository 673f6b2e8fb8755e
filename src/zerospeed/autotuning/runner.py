"""The autotuner: short profiled runs of the user's script over ZeRO stages, micro-batch sizes and (unless
``fast``) each stage's tuning space, pruned by a memory estimate; writes ``ds_config_optimal.json``,
``cmd_optimal.txt`` and ``summary.txt`` to ``results_dir`` (DeepSpeed's files), each experiment's config to
``exps_dir`` and its logs beside its metrics.

Every experiment is ``zerospeed launch`` of the script with the experiment's config in place of the one given
(``--deepspeed_config``, ``--config`` or ``autotuning.arg_mappings``); the engine profiles steps
``[start_profile_step, end_profile_step)``, writes the metric and ends the run (``runtime/autotuning_probe``).
The user's own config runs first as ``default``, so the result is compared with what they had.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ..config import load_config
from .memory import fits, model_state_bytes
from .space import DEFAULT_TUNING_SPACE, GAS, MICRO, canonical_name, expand, tuning_keys
from .tuner import TUNERS

CONFIG_FLAGS = ("--deepspeed_config", "--config", "--zerospeed_config")


@dataclass
class Result:
    name: str
    config: dict[str, Any]
    metric: float | None
    seconds: float
    note: str = ""


@dataclass
class Autotuner:
    script: str
    script_args: list[str]
    nproc: int = 1
    timeout_s: float = 600.0
    available_bytes: int | None = None
    results: list[Result] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.flag, path = self._config_arg()
        with open(path) as f:
            self.base: dict[str, Any] = json.load(f)
        self.at = load_config({**self.base, "train_micro_batch_size_per_gpu": 1, "train_batch_size": None,
                               "gradient_accumulation_steps": None}).autotuning
        os.makedirs(self.at.results_dir, exist_ok=True)
        os.makedirs(self.at.exps_dir, exist_ok=True)

    # --- the script's config argument --------------------------------------------------------------------
    def _config_arg(self) -> tuple[str, str]:
        flags = list(CONFIG_FLAGS)
        mapped = (self._peek_mappings() or {}).get("deepspeed_config")
        if mapped:
            flags.insert(0, mapped)
        for i, arg in enumerate(self.script_args):
            for flag in flags:
                if arg == flag and i + 1 < len(self.script_args):
                    return flag, self.script_args[i + 1]
                if arg.startswith(flag + "="):
                    return flag, arg.split("=", 1)[1]
        raise ValueError(f"the script's arguments name no config ({' / '.join(flags)} PATH): the autotuner needs "
                         "one to replace per experiment (or set autotuning.arg_mappings.deepspeed_config)")

    def _peek_mappings(self) -> dict[str, str] | None:
        for i, arg in enumerate(self.script_args):
            if arg in CONFIG_FLAGS and i + 1 < len(self.script_args):
                try:
                    with open(self.script_args[i + 1]) as f:
                        at = load_config({**json.load(f), "train_micro_batch_size_per_gpu": 1,
                                          "train_batch_size": None, "gradient_accumulation_steps": None}).autotuning
                    return at.arg_mappings
                except (OSError, ValueError):
                    return None
        return None

    def _args_with(self, path: str, config: dict[str, Any] | None = None) -> list[str]:
        """The script's arguments with the config path replaced, and (``autotuning.arg_mappings``: config key
        -> script flag, as in DeepSpeed) each mapped flag set to the experiment's value of its key."""
        replace = {self.flag: path}
        for key, flag in (self.at.arg_mappings or {}).items():
            if key != "deepspeed_config" and config is not None and key in config:
                replace[flag] = str(config[key])
        out, skip, seen = [], False, set()
        for arg in self.script_args:
            if skip:
                skip = False
                continue
            flag = arg.split("=", 1)[0]
            if flag in replace:
                out += [flag, replace[flag]]
                seen.add(flag)
                skip = "=" not in arg
            else:
                out.append(arg)
        for flag, value in replace.items():
            if flag not in seen:
                out += [flag, value]
        return out

    # --- one experiment ----------------------------------------------------------------------------------
    def run(self, name: str, config: dict[str, Any], model_info: bool = False) -> Result:
        exp_dir = os.path.join(self.at.results_dir, name)
        os.makedirs(exp_dir, exist_ok=True)
        metric_path = os.path.join(exp_dir, "metrics.json")
        info_path = os.path.join(exp_dir, "model_info.json")
        cfg = copy.deepcopy(config)
        cfg["autotuning"] = {**(cfg.get("autotuning") or {}), "enabled": True, "metric_path": metric_path,
                             "model_info_path": info_path, "model_info": {"profile": model_info}}
        exp_path = os.path.join(self.at.exps_dir, f"{name}.json")
        with open(exp_path, "w") as f:
            json.dump(cfg, f, indent=2)
        path = info_path if model_info else metric_path
        if not self.at.overwrite and os.path.isfile(path):  # DeepSpeed's overwrite=false: keep earlier results
            return self._read(name, config, path, model_info, 0.0, "reused")
        for stale in (metric_path, info_path):
            if os.path.exists(stale):
                os.remove(stale)
        cmd = [sys.executable, "-m", "zerospeed.launcher.cli", "launch", "--nproc-per-node", str(self.nproc),
               self.script, *self._args_with(exp_path, cfg)]
        t0 = time.perf_counter()
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s)
            code, stdout, stderr = out.returncode, out.stdout, out.stderr
        except subprocess.TimeoutExpired as exc:
            code, stdout, stderr = -1, str(exc.stdout or ""), f"timed out after {self.timeout_s} s"
        seconds = time.perf_counter() - t0
        with open(os.path.join(exp_dir, "stdout.log"), "w") as f:
            f.write(stdout)
        with open(os.path.join(exp_dir, "stderr.log"), "w") as f:
            f.write(stderr)
        if code != 0 or not os.path.isfile(path):
            tail = stderr.strip().splitlines()[-1:] or [f"exit code {code}"]
            return Result(name, config, None, seconds, f"failed: {tail[0][:160]}")
        return self._read(name, config, path, model_info, seconds, "")

    def _read(self, name: str, config: dict[str, Any], path: str, model_info: bool, seconds: float,
              note: str) -> Result:
        with open(path) as f:
            data = json.load(f)
        if model_info:
            return Result(name, config, float(data["num_params"]), seconds, note or "model info")
        value = data.get(self.at.metric)
        if value is None:
            return Result(name, config, None, seconds, f"no '{self.at.metric}' metric")
        return Result(name, config, -float(value) if self.at.metric == "latency" else float(value), seconds, note)

    def measure(self, name: str, config: dict[str, Any]) -> float | None:
        result = self.run(name, config)
        self.results.append(result)
        return result.metric

    # --- the search ----------------------------------------------------------------------------------------
    def _num_params(self) -> int:
        if self.at.model_info.num_params:
            return self.at.model_info.num_params
        base = self._with_micro(self.base, self.at.min_train_micro_batch_size_per_gpu)
        info = self.run("model_info", base, model_info=True)
        if info.metric is None:
            raise RuntimeError(f"the model-info run failed ({info.note}); see {self.at.results_dir}/model_info")
        return int(info.metric)

    def _with_micro(self, config: dict[str, Any], micro: int) -> dict[str, Any]:
        cfg = copy.deepcopy(config)
        cfg.pop("train_batch_size", None)
        cfg[MICRO] = micro
        cfg.setdefault(GAS, 1)
        return cfg

    def _micro_sizes(self) -> list[int]:
        sizes, m = [], self.at.min_train_micro_batch_size_per_gpu
        gas = int(self.base.get(GAS) or 1)
        while m <= self.at.max_train_micro_batch_size_per_gpu and len(sizes) < self.at.num_tuning_micro_batch_sizes:
            batch = m * self.nproc * gas // self.at.mp_size
            if batch > (self.at.max_train_batch_size or batch):
                break
            if batch >= self.at.min_train_batch_size:
                sizes.append(m)
            m *= 2
        return sizes

    def tune(self) -> Result:
        if self.available_bytes is None:
            import psutil

            self.available_bytes = int(psutil.virtual_memory().available)
        num_params = self._num_params()
        default = self.base if MICRO in self.base or "train_batch_size" in self.base else \
            self._with_micro(self.base, self.at.min_train_micro_batch_size_per_gpu)
        self.measure("default", default)
        for stage in (0, 1, 2, 3):
            space = copy.deepcopy(DEFAULT_TUNING_SPACE[stage])
            stage_cfg = {**copy.deepcopy(self.base), "zero_optimization": {
                **(self.base.get("zero_optimization") or {}), **space["zero_optimization"]}}
            per_rank_params = num_params // self.at.mp_size  # model parallelism splits the parameters first
            if not fits(stage_cfg, per_rank_params, self.nproc, self.available_bytes):
                need = model_state_bytes(per_rank_params, stage, self.nproc)
                self.results.append(Result(f"z{stage}", stage_cfg, None, 0.0,
                                           f"pruned: model states {need / 2**20:.0f} MiB per rank do not fit"))
                continue
            fixed = {**stage_cfg, "zero_optimization": {k: v for k, v in stage_cfg["zero_optimization"].items()
                                                        if not isinstance(v, list)}}
            best_micro, best_metric = None, None
            for micro in self._micro_sizes():  # ascend; the first failure ends the stage's ascent
                cfg = self._with_micro(fixed, micro)
                metric = self.measure(canonical_name(cfg, [MICRO, GAS], prefix=f"z{stage}_"), cfg)
                if metric is None:
                    break
                if best_metric is None or metric > best_metric:
                    best_micro, best_metric = micro, metric
            if self.at.fast or best_micro is None:
                continue
            exps = expand(self._with_micro(stage_cfg, best_micro))
            keys = tuning_keys(space)
            tuner = TUNERS[self.at.tuner_type](exps, self.at.tuner_num_trials, self.at.tuner_early_stopping)
            tuner.tune(lambda exp: self.measure(canonical_name(exp, keys, prefix=f"z{stage}_"), exp))
        return self._write()

    def _write(self) -> Result:
        done = [r for r in self.results if r.metric is not None]
        if not done:
            raise RuntimeError(f"no experiment succeeded; see {self.at.results_dir}/*/stderr.log")
        best = max(done, key=lambda r: r.metric)  # type: ignore[arg-type, return-value]
        optimal = copy.deepcopy(best.config)
        optimal.pop("autotuning", None)
        with open(os.path.join(self.at.results_dir, "ds_config_optimal.json"), "w") as f:
            json.dump(optimal, f, indent=2)
        opt_path = os.path.abspath(os.path.join(self.at.results_dir, "ds_config_optimal.json"))
        cmd = (f"zerospeed launch --nproc-per-node {self.nproc} {self.script} "
               f"{' '.join(self._args_with(opt_path, optimal))}")
        with open(os.path.join(self.at.results_dir, "cmd_optimal.txt"), "w") as f:
            f.write(cmd + "\n")
        unit = {"throughput": "samples/s", "latency": "s/step", "flops": "FLOP/s"}[self.at.metric]
        lines = [f"{'experiment':40s} {self.at.metric + ' (' + unit + ')':>24s} {'run s':>7s}  note"]
        for r in self.results:
            shown = "-" if r.metric is None else f"{abs(r.metric):.4g}"
            lines.append(f"{r.name:40s} {shown:>24s} {r.seconds:7.1f}  {r.note}")
        lines.append(f"\noptimal: {best.name}; command: {cmd}")
        with open(os.path.join(self.at.results_dir, "summary.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
        return best
