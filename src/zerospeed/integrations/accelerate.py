"""An Accelerate config (``accelerate config`` -> ``default_config.yaml``, ``distributed_type: DEEPSPEED``) as a
zerospeed (DeepSpeed JSON) config, plus the ``zerospeed launch`` flags its launcher settings mean.

Every key of its ``deepspeed_config`` block is mapped, turned into a launch flag, or refused by name: nothing
is dropped without a word. ``zerospeed convert-accelerate`` is the command line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_LAUNCH_KEYS = {
    "deepspeed_hostfile": "--hostfile", "deepspeed_inclusion_filter": "--include",
    "deepspeed_exclusion_filter": "--exclude", "deepspeed_multinode_launcher": "--launcher",
}
_NOT_CONFIG = {
    "zero3_init_flag": "build the model inside zerospeed.zero.Init(config_dict_or_path=...) (HF: from_pretrained "
                       "does it for you when given the config)",
}
_UNSUPPORTED = {"deepspeed_moe_layer_cls_names": "MoE leaf modules for ZeRO-3 are not supported yet by zerospeed"}


def _read(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(source, dict):
        return dict(source)
    text = Path(source).read_text()
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - Accelerate itself depends on PyYAML
        raise ImportError("reading an Accelerate YAML config needs PyYAML (pip install pyyaml)") from exc
    data = yaml.safe_load(text) if str(source).endswith((".yaml", ".yml")) else json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{source} does not hold a mapping")
    return data


def from_accelerate(source: str | Path | dict[str, Any], micro_batch: int | None = None
                    ) -> tuple[dict[str, Any], list[str], list[str]]:
    """``(config, launch_flags, notes)`` for an Accelerate config (a path to its YAML/JSON, or the dict)."""
    acc = _read(source)
    kind = str(acc.get("distributed_type", "DEEPSPEED")).upper()
    if kind != "DEEPSPEED":
        raise ValueError(f"distributed_type is {kind}, not DEEPSPEED: this converter reads Accelerate's DeepSpeed "
                         "configs (for plain multi-process runs `zerospeed launch` needs no conversion)")
    ds = dict(acc.get("deepspeed_config") or {})
    notes: list[str] = []
    flags: list[str] = []
    if "deepspeed_config_file" in ds:
        path = Path(ds.pop("deepspeed_config_file"))
        if not path.is_absolute() and not isinstance(source, dict):
            path = Path(source).parent / path
        cfg: dict[str, Any] = json.loads(path.read_text())
        extra = sorted(k for k in ds if k not in _LAUNCH_KEYS and k not in _NOT_CONFIG)
        if extra:
            raise ValueError(f"deepspeed_config_file is given, so {extra} must not be (as in Accelerate): they "
                             "belong in that JSON file")
    else:
        cfg = {}
        zero: dict[str, Any] = {"stage": int(ds.pop("zero_stage", 2))}
        for side in ("optimizer", "param"):
            device = str(ds.pop(f"offload_{side}_device", "none"))
            nvme = ds.pop(f"offload_{side}_nvme_path", None)
            if device not in ("none", "cpu", "nvme"):
                raise ValueError(f"offload_{side}_device is {device!r}; one of none, cpu, nvme")
            if device != "none":
                zero[f"offload_{side}"] = {"device": device, **({"nvme_path": nvme} if nvme else {})}
        if "zero3_save_16bit_model" in ds:
            zero["stage3_gather_16bit_weights_on_model_save"] = bool(ds.pop("zero3_save_16bit_model"))
        cfg["zero_optimization"] = zero
        if "gradient_accumulation_steps" in ds:
            cfg["gradient_accumulation_steps"] = int(ds.pop("gradient_accumulation_steps"))
        if "gradient_clipping" in ds:
            cfg["gradient_clipping"] = float(ds.pop("gradient_clipping"))
    precision = str(acc.get("mixed_precision", "no")).lower()
    if precision == "bf16":
        cfg.setdefault("bf16", {"enabled": True})
    elif precision == "fp16":
        cfg.setdefault("fp16", {"enabled": True})
    elif precision not in ("no", "none"):
        raise ValueError(f"mixed_precision {precision!r} is not supported with zerospeed (no, fp16 or bf16)")
    if micro_batch is not None:
        cfg["train_micro_batch_size_per_gpu"] = micro_batch
    elif not any(k in cfg for k in ("train_micro_batch_size_per_gpu", "train_batch_size")):
        notes.append("no batch size: Accelerate takes it from the data loader; add train_micro_batch_size_per_gpu "
                     "(or pass --micro-batch)")
    for key, flag in _LAUNCH_KEYS.items():
        if key in ds:
            value = ds.pop(key)
            if key == "deepspeed_multinode_launcher" and value == "standard":
                value = "ssh"  # Accelerate's 'standard' runs torchrun on each node; zerospeed's ssh does the same
            flags += [flag, str(value)]
    for key, why in _NOT_CONFIG.items():
        if ds.pop(key, None):
            notes.append(f"{key}: {why}")
    bad = {k: _UNSUPPORTED.get(k, "unknown to zerospeed's converter") for k in ds}
    if bad:
        raise ValueError("cannot convert " + "; ".join(f"deepspeed_config.{k}: {v}" for k, v in sorted(bad.items())))
    procs = int(acc.get("num_processes", 1) or 1)
    machines = int(acc.get("num_machines", 1) or 1)
    flags = ["--nproc-per-node", str(max(1, procs // machines)), *(["--nnodes", str(machines)] if machines > 1 else []),
             *flags]
    if acc.get("main_process_ip"):
        flags += ["--master_addr", str(acc["main_process_ip"])]
    if acc.get("main_process_port"):
        flags += ["--master_port", str(acc["main_process_port"])]
    return cfg, flags, notes
