"""``zerospeed convert-deepspeed``: a DeepSpeed ZeRO 1-3 checkpoint becomes a zerospeed checkpoint that resumes
training with its optimizer state, schedule and counters.

The DeepSpeed files are read whole (``deepspeed_read``: weights-only, no code from the pickles) and written as
one zerospeed checkpoint that records DeepSpeed's world size and stage: it resumes directly on the same
partitioning, and at any other world size or stage with ``"checkpoint": {"load_universal": true}``, as a
DeepSpeed checkpoint would need DeepSpeed's universal conversion.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from . import layout
from .deepspeed_read import DeepSpeedState, read_deepspeed_checkpoint, tag_dir
from .errors import CheckpointError
from .state import to_json
from .save import CLIENT_FILE
from .tensor_file import write_tensors

_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad", "lamb": "Lamb"}


def _optimizer_type(config: dict[str, Any]) -> str:
    """The torch class name zerospeed's factory builds for DeepSpeed's ``optimizer.type`` (Adam with its
    default ``adam_w_mode`` is AdamW)."""
    spec = config.get("optimizer") or {}
    name = str(spec.get("type", "")).lower()
    params = spec.get("params") or {}
    if name == "adam" and params.get("adam_w_mode", True):
        return "AdamW"
    return _OPTIMIZERS.get(name, str(spec.get("type", "?")))


def _compute_dtype(config: dict[str, Any]) -> str:
    if (config.get("bf16") or config.get("bfloat16") or {}).get("enabled"):
        return "bfloat16"
    return "float16" if (config.get("fp16") or {}).get("enabled") else "float32"


def _loss_scaler(ds: DeepSpeedState) -> dict[str, Any]:
    s = ds.loss_scaler or {}
    return {"cur_scale": float(s.get("cur_scale", 1.0)), "cur_iter": int(s.get("cur_iter", 0)),
            "last_overflow_iter": int(s.get("last_overflow_iter", -1)),
            "cur_hysteresis": int(s.get("cur_hys", s.get("delayed_shift", 1)))}


def _check_target(ds_dir: str, tag: str | None, out_dir: str, out_tag: str, overwrite: bool) -> None:
    """The source is never touched: the output tag may not be the DeepSpeed tag directory (nor hold it), and an
    existing output tag is refused unless ``overwrite`` (then only zerospeed's own files in it are replaced)."""
    source = os.path.realpath(tag_dir(ds_dir, tag))
    target = os.path.realpath(os.path.join(out_dir, out_tag))
    if target == source or source.startswith(target + os.sep):
        raise CheckpointError(f"convert-deepspeed: the output {os.path.join(out_dir, out_tag)} is the DeepSpeed "
                              f"checkpoint being converted ({source}); the source is never modified: pass another "
                              "OUT_DIR or --out-tag")
    layout.check_overwrite(out_dir, out_tag, overwrite)


def _carried_state(ds: DeepSpeedState, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What DeepSpeed stored beside the model and optimizer, as zerospeed metadata: the client state (its
    tensors into ``tensors``), the curriculum sampler's state (the loader's) and random-LTD's."""
    try:
        client = to_json(ds.client_state, "client_state", tensors)
        data = None if ds.data_sampler is None else to_json(ds.data_sampler, "data_sampler")
        ltd = None if ds.random_ltd is None else {"random_ltd": to_json(ds.random_ltd, "random_ltd")}
    except ValueError as exc:
        raise CheckpointError(f"convert-deepspeed: {exc}") from None
    return {"client_state": client, "data": data, "data_efficiency": ltd}


def convert_deepspeed(ds_dir: str, out_dir: str, tag: str | None = None, out_tag: str | None = None,
                      overwrite: bool = False) -> dict[str, Any]:
    """Write the zerospeed checkpoint; returns ``{"path", "tensors", "stage", "world_size", "deepspeed"}``.

    ``ds_dir`` is only read. An existing ``out_dir/out_tag`` is refused unless ``overwrite``; then only
    zerospeed's own files are replaced and every other file in it is kept."""
    ds_dir, out_dir = os.fspath(ds_dir), os.fspath(out_dir)
    ds = read_deepspeed_checkpoint(ds_dir, tag)
    order = ds.order
    out_tag = layout.check_tag(out_tag or f"global_step{ds.counters['global_steps']}")
    _check_target(ds_dir, tag, out_dir, out_tag, overwrite)
    client_tensors: dict[str, torch.Tensor] = {}
    carried = _carried_state(ds, client_tensors)
    entries: dict[str, Any] = {}
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, list[int]] = {}
    module_tensors: dict[str, torch.Tensor] = {}
    opt_layout: dict[str, Any] = {}
    known = set(ds.params) | set(ds.frozen) | set(ds.shared)
    missing = [k for k, _ in order if k not in known]
    if missing:
        raise CheckpointError(f"the DeepSpeed checkpoint has no data for {missing[:5]}")
    for key, dtype in order:
        if key in ds.shared:
            base = ds.shared[key]
            entries[key] = dict(entries.get(base) or {"shape": list(ds.params[base].shape), "dtype": str(dtype)
                                                      .removeprefix("torch."), "source": "master"})
            entries[key]["alias_of"] = base
            continue
        t = ds.params.get(key)
        if t is None:
            module_tensors[key] = ds.frozen[key].contiguous()
            entries[key] = {"shape": list(ds.frozen[key].shape), "dtype": str(ds.frozen[key].dtype)
                            .removeprefix("torch."), "source": "module"}
            continue
        entries[key] = {"shape": list(t.shape), "dtype": str(dtype).removeprefix("torch."), "source": "master"}
        shard[f"master/{key}"] = t.reshape(-1).contiguous()
        index[f"master/{key}"] = [0, t.numel()]
        lay: dict[str, Any] = {"elementwise": [], "scalar": [], "values": {}}
        for k, v in ds.optim.get(key, {}).items():
            shard[f"optim/{k}/{key}"] = v.reshape(-1).contiguous()
            index[f"optim/{k}/{key}"] = [0, v.numel()]
            lay["elementwise"].append(k)
        step = ds.steps.get(ds.group_of[key])
        if step is not None:
            shard[f"scalar/step/{key}"] = step.reshape(())
            index[f"scalar/step/{key}"] = [0, 1]
            lay["scalar"].append("step")
        opt_layout[key] = lay
    gas = int(ds.config.get("gradient_accumulation_steps") or 1)
    meta = {
        "format": layout.FORMAT, "version": layout.VERSION, "world_size": ds.world_size, "zero_stage": ds.stage,
        "compute_dtype": _compute_dtype(ds.config), "tensors": entries,
        "optimizer": {"type": _optimizer_type(ds.config),
                      "param_groups": [to_json(g, f"param_groups[{i}]") for i, g in enumerate(ds.param_groups)],
                      "layout": opt_layout, "loss_scaler": _loss_scaler(ds)},
        "lr_scheduler": to_json(ds.lr_scheduler, "lr_scheduler") if ds.lr_scheduler else None,
        "engine": {**ds.counters, "micro_steps": ds.counters["global_steps"] * gas, "gradient_accumulation_steps": gas},
        **carried,
        "converted_from": {"deepspeed": ds.version, "path": os.path.abspath(ds_dir), "zero_stage": ds.stage,
                           "world_size": ds.world_size},
    }
    os.makedirs(out_dir, exist_ok=True)
    staging = layout.begin(out_dir, out_tag)
    try:
        os.makedirs(os.path.join(staging, "shards"), exist_ok=True)
        files: dict[str, dict[str, Any]] = {}
        outputs = [(layout.shard_file(0), shard), (layout.MODULE_FILE, module_tensors)]
        if client_tensors:
            outputs.append((CLIENT_FILE, client_tensors))
        for rel, tensors in outputs:
            size, digest = write_tensors(os.path.join(staging, rel), tensors, {"format": "pt"})
            files[rel] = {"bytes": size, "sha256": digest}
        size, digest = layout.write_json(os.path.join(staging, layout.META), meta)
        files[layout.META] = {"bytes": size, "sha256": digest}
        layout.fsync_dir(os.path.join(staging, "shards"))
        layout.publish_marker(staging, 0, files, index)
        final = layout.commit(out_dir, out_tag, staging, layout.wait_markers(staging, 1, 60.0), save_latest=True,
                              overwrite=overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"path": final, "tensors": len(entries), "stage": ds.stage, "world_size": ds.world_size,
            "deepspeed": ds.version}
