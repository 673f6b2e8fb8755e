"""Reading a DeepSpeed ZeRO 1-3 checkpoint into whole fp32 tensors, without ever running its pickles.

DeepSpeed's ``.pt`` files are pickles. They are opened only with ``torch.load(weights_only=True)``, which
builds tensors and plain containers and refuses every other global; the three DeepSpeed classes its ZeRO
files name (``LossScaler``/``DynamicLossScaler``, ``ZeroStageEnum``, ``fragment_address``) are mapped to
inert stand-ins here that only hold their fields. A file that needs anything else is refused, not run.

Layout (DeepSpeed 0.19.x, one model-parallel rank):

- stages 1-2: ``mp_rank_00_model_states.pt`` (module state, ``param_shapes`` per group, counters, scheduler) and
  ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank R: each group's fp32 master is one flat
  vector in parameter order, cut into ``partition_count`` equal partitions (the last padded); the optimizer's
  element-wise state has the same layout.
- stage 3: ``zero_pp_rank_R_mp_rank_00_{model,optim}_states.pt``: each parameter is cut on its own into
  ``ceil(numel / world)`` elements per rank; a rank's flat vector is its pieces in parameter order.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import CheckpointError
from .layout import read_pointer


# --- inert stand-ins for the DeepSpeed classes its checkpoints pickle -------------------------------
class _Fields:
    """Holds the fields a pickled DeepSpeed object carried, as a plain dict in ``fields``; no behaviour, and no
    attribute is set from the file's keys."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}

    def __setstate__(self, state: object) -> None:
        self.fields = dict(state) if isinstance(state, dict) else {}


class _LossScaler(_Fields):
    pass


class _FragmentAddress(_Fields):
    pass


def _zero_stage(value: int) -> int:
    return int(value)


_STAND_INS: list[Any] = [
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


def safe_load(path: str) -> Any:
    """``torch.load(weights_only=True)`` with DeepSpeed's inert stand-ins; anything else is refused."""
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the unpickler's refusal, or a damaged file
        text = str(exc)
        found = re.search(r"GLOBAL ([\w.]+)", text)
        lines = [ln for ln in text.splitlines() if ln.strip()]
        what = f"it needs '{found.group(1)}'" if found else f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"
        raise CheckpointError(f"refusing to load {path}: {what}, which a weights-only load does not build. "
                              "zerospeed never unpickles arbitrary objects from a checkpoint (they can run code)"
                              ) from None


# --- the whole state, by parameter name --------------------------------------------------------------
@dataclass
class DeepSpeedState:
    """A DeepSpeed checkpoint as whole tensors: fp32 masters and optimizer state per parameter name."""

    stage: int
    world_size: int
    params: dict[str, torch.Tensor]  # trainable: fp32 master, full shape, in DeepSpeed's group order
    group_of: dict[str, int]
    frozen: dict[str, torch.Tensor]  # frozen parameters and buffers, whole
    shared: dict[str, str]  # tied name -> the name it shares storage with
    optim: dict[str, dict[str, torch.Tensor]]  # per parameter: element-wise state (same shape as the param)
    steps: dict[int, torch.Tensor]  # per group: the optimizer's step count
    param_groups: list[dict[str, Any]]
    loss_scaler: dict[str, Any] | None
    lr_scheduler: dict[str, Any] | None
    counters: dict[str, int]
    config: dict[str, Any]
    version: str
    client_state: dict[str, Any] = field(default_factory=dict)  # the keys DeepSpeed's client_state added
    data_sampler: Any = None
    random_ltd: Any = None
    order: list[tuple[str, torch.dtype]] = field(default_factory=list)  # state-dict keys, model's dtypes


# the keys DeepSpeed's engine writes into mp_rank_00_model_states.pt; everything else is its client_state
DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "ds_universal_checkpoint_info"})


def tag_dir(ds_dir: str, tag: str | None) -> str:
    if tag is None:
        latest = os.path.join(ds_dir, "latest")
        if not os.path.lexists(latest):
            raise CheckpointError(f"{ds_dir} has no 'latest' file: pass the tag (the checkpoint's sub-directory)")
        tag = read_pointer(latest)
    path = os.path.join(ds_dir, str(tag))
    if not os.path.isdir(path):
        raise CheckpointError(f"DeepSpeed checkpoint directory {path} does not exist")
    return path


def _rank_files(path: str, kind: str) -> list[str]:
    files = glob.glob(os.path.join(path, f"*zero_pp_rank_*_mp_rank_*_{kind}_states.pt"))
    if any(re.search(r"mp_rank_(?!00)\d+", os.path.basename(f)) for f in files):
        raise CheckpointError(f"{path} holds a tensor- or pipeline-parallel DeepSpeed checkpoint (mp_rank > 0): "
                              "converting those is not supported yet by zerospeed")
    if any("expp_rank" in os.path.basename(f) or "expert_" in os.path.basename(f) for f in os.listdir(path)):
        raise CheckpointError(f"{path} holds a DeepSpeed MoE checkpoint: converting those is not supported yet by "
                              "zerospeed")

    def rank(f: str) -> int:
        m = re.search(r"zero_pp_rank_(\d+)_", os.path.basename(f))
        assert m is not None
        return int(m.group(1))

    files.sort(key=rank)
    if [rank(f) for f in files] != list(range(len(files))):
        raise CheckpointError(f"{path}: the {kind} files of ranks {[rank(f) for f in files]} are not 0..N-1 "
                              "(a rank's file is missing)")
    return files


def _flat_shapes(param_shapes: Any) -> list[dict[str, torch.Size]]:
    groups = param_shapes if isinstance(param_shapes, list) else [param_shapes]
    return [dict(g) for g in groups]


def read_deepspeed_checkpoint(ds_dir: str, tag: str | None = None) -> DeepSpeedState:
    """Every parameter's fp32 master and optimizer state, whole, from a DeepSpeed ZeRO 1-3 checkpoint.
    Files that do not hold what DeepSpeed writes raise one ``CheckpointError`` naming the directory."""
    path = tag_dir(os.fspath(ds_dir), tag)
    try:
        return _read(path)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError, RuntimeError) as exc:
        what = f"missing entry {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise CheckpointError(f"{path} is not a DeepSpeed ZeRO checkpoint zerospeed can read ({what})") from None


def _read(path: str) -> DeepSpeedState:
    optim_files = _rank_files(path, "optim")
    if not optim_files:
        raise CheckpointError(f"{path} has no zero_pp_rank_*_optim_states.pt: not a DeepSpeed ZeRO checkpoint "
                              "(stage 0 checkpoints are not supported yet by zerospeed's converter)")
    optim = [safe_load(f)["optimizer_state_dict"] for f in optim_files]
    stage = int(optim[0].get("zero_stage", 0))
    world = len(optim_files)
    model_files = _rank_files(path, "model") if stage == 3 else [os.path.join(path, "mp_rank_00_model_states.pt")]
    if not os.path.isfile(model_files[0]):
        raise CheckpointError(f"{path} has no {os.path.basename(model_files[0])}")
    models = [safe_load(f) for f in model_files]
    head = models[0]
    shapes = _flat_shapes(head["param_shapes"])
    if stage in (1, 2):
        params, states, steps = _stage12(optim, shapes, world)
        pg = optim[0]["base_optimizer_state"]["param_groups"]
    elif stage == 3:
        params, states, steps = _stage3(optim, shapes, world)
        pg = optim[0]["optimizer_state_dict"]["param_groups"]
    else:
        raise CheckpointError(f"{path}: ZeRO stage {stage} is not one zerospeed converts (1, 2 or 3)")
    group_of = {name: gi for gi, g in enumerate(shapes) for name in g}
    frozen = _frozen(models, stage, world, head)
    scaler = optim[0].get("loss_scaler")
    return DeepSpeedState(
        stage=stage, world_size=world, params=params, group_of=group_of, frozen=frozen,
        shared=dict(head.get("shared_params") or {}), optim=states, steps=steps,
        param_groups=[{k: v for k, v in g.items() if k != "params"} for g in pg],
        loss_scaler=dict(getattr(scaler, "fields", {})) if isinstance(scaler, _Fields) else None,
        lr_scheduler=head.get("lr_scheduler"),
        counters={"global_steps": int(head.get("global_steps", 0)), "global_samples": int(head.get("global_samples", 0)),
                  "skipped_steps": int(head.get("skipped_steps", 0))},
        config=dict(head.get("ds_config") or {}), version=str(head.get("ds_version", "?")),
        order=[(k, v.dtype) for k, v in head["module"].items()],
        client_state={k: v for k, v in head.items() if k not in DEEPSPEED_KEYS},
        data_sampler=head.get("data_sampler"), random_ltd=head.get("random_ltd"))


def _split(flat: torch.Tensor, shapes: dict[str, torch.Size], what: str, pads: list[int] | None = None
           ) -> dict[str, torch.Tensor]:
    """Cut one group's whole flat vector into its parameters (stages 1-2)."""
    out, offset = {}, 0
    for i, (name, shape) in enumerate(shapes.items()):
        n = int(torch.Size(shape).numel())
        if offset + n > flat.numel():
            raise CheckpointError(f"{what}: the flat vector has {flat.numel()} elements, too few for {name} at {offset}")
        out[name] = flat[offset:offset + n].view(shape).clone()
        offset += n + (pads[i] if pads else 0)
    return out


def _stage12(optim: list[dict[str, Any]], shapes: list[dict[str, torch.Size]], world: int
             ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], dict[int, torch.Tensor]]:
    params: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    steps: dict[int, torch.Tensor] = {}
    counts = optim[0].get("partition_count")
    for gi, group_shapes in enumerate(shapes):
        count = counts[gi] if isinstance(counts, list) else counts
        if count != world:
            raise CheckpointError(f"group {gi} was partitioned over {count} ranks but the checkpoint has {world} "
                                  "rank files")
        flat = torch.cat([o["single_partition_of_fp32_groups"][gi].float() for o in optim])
        pads = (optim[0].get("param_alignment_paddings") or [None] * (gi + 1))[gi]
        params.update(_split(flat, group_shapes, f"group {gi} fp32", pads))
        rank_states = [o["base_optimizer_state"]["state"].get(gi, {}) for o in optim]
        for key, value in rank_states[0].items():
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() == optim[0][
                    "single_partition_of_fp32_groups"][gi].numel():
                whole = torch.cat([s[key].float() for s in rank_states])
                for name, t in _split(whole, group_shapes, f"group {gi} {key}", pads).items():
                    states.setdefault(name, {})[key] = t
            elif key == "step":
                steps[gi] = torch.as_tensor(value, dtype=torch.float32).clone()
    return params, states, steps


def _stage3(optim: list[dict[str, Any]], shapes: list[dict[str, torch.Size]], world: int
            ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], dict[int, torch.Tensor]]:
    merged = {name: shape for g in shapes for name, shape in g.items()}
    flats = [torch.cat([t.float() for t in o["fp32_flat_groups"]]) for o in optim]
    sub_states = [o["optimizer_state_dict"]["state"] for o in optim]
    keys = [k for k, v in sub_states[0].get(0, {}).items() if torch.is_tensor(v) and v.dim() == 1]
    state_flats = {k: [torch.cat([s[i][k].float() for i in sorted(s)]) for s in sub_states] for k in keys}
    params: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    offset = 0
    for name, shape in merged.items():
        n = int(torch.Size(shape).numel())
        part = -(-n // world)
        if offset + part > flats[0].numel():
            raise CheckpointError(f"stage 3 fp32 partitions hold {flats[0].numel()} elements, too few for {name}")
        params[name] = torch.cat([f[offset:offset + part] for f in flats])[:n].view(shape).clone()
        for k, per_rank in state_flats.items():
            states.setdefault(name, {})[k] = torch.cat([f[offset:offset + part] for f in per_rank])[:n].view(shape).clone()
        offset += part
    step = sub_states[0].get(0, {}).get("step")
    steps = {gi: torch.as_tensor(step, dtype=torch.float32).clone() for gi in range(len(shapes))} if step is not None else {}
    return params, states, steps


def _frozen(models: list[dict[str, Any]], stage: int, world: int, head: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Frozen parameters and buffers, whole (stage 3 keeps frozen parameters as per-rank fragments)."""
    out: dict[str, torch.Tensor] = {}
    module = head["module"]
    for name in head.get("buffer_names") or []:
        if name in module:
            out[name] = module[name].clone()
    frozen_shapes = dict(head.get("frozen_param_shapes") or {})
    for name, shape in frozen_shapes.items():
        if stage == 3:
            n = int(torch.Size(shape).numel())
            pieces = [m["frozen_param_fragments"][name].reshape(-1) for m in models]
            out[name] = torch.cat(pieces)[:n].view(shape).clone()
        else:
            out[name] = module[name].clone()
    return out
