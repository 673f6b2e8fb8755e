"""AutoTP's placement rules: which layers of a model are column-parallel, row-parallel or left whole.

A pure function of the module tree (no processes): ``plan_model(model, autotp_config)`` returns one
``Placement`` per splittable layer (``nn.Linear`` and Hugging Face's ``Conv1D``), or raises ``ValueError``
naming every layer the rules cannot place. The order of decision for a layer named ``n``:

1. the user's / preset's ``layer_specs``, first match on ``n + '.weight'`` wins;
2. with no match and ``use_default_specs`` false: an error (list the layer, or add a ``skip`` spec);
3. DeepSpeed's built-in rules (``AutoTP.tp_parser`` and ``_replace``):
   - routers and low-rank projections stay whole (``gate``/``router``/``shared_expert_gate`` of an MoE
     block, ``q_a_proj``, ``kv_a_proj_with_mqa``);
   - row for output projections (``o_proj``, ``out_proj``, ``down_proj``, ``dense_4h_to_h``, ``attention.dense``,
     Mixtral's ``w2``) and for the last linear before a norm in a repeated block (in a pre-norm block such as
     GPT-2's the block's last linear precedes the next block's first norm);
   - the output head (``lm_head``/``embed_out``) is column with a gathered output, or left whole when its weight
     is tied to an embedding (DeepSpeed's training fallback);
   - column otherwise, inside a repeated block (an ``nn.ModuleList`` of layers);
   - a linear outside every repeated block that is not the head: an error naming it.

Checks after placing: each repeated block that splits anything has a row layer closing its column layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from torch import nn

from .autotp_config import AutoTPConfig, PartitionType, TPLayerSpec

_ROW_NAMES = ("o_proj", "out_proj", "down_proj", "dense_4h_to_h")
_SKIP_LEAVES = ("gate", "router", "shared_expert_gate", "q_a_proj", "kv_a_proj_with_mqa")
_NORM_KEYS = ("LayerNorm", "layer_norm", "ln_1", "ln_2")
FUSED_QKV_NAMES = ("qkv_proj", "query_key_value", "attn.Wqkv", "self_attn.W_pack", "c_attn", "attn.qkv")
"""DeepSpeed's fused-QKV names (``require_tp_fused_qkvw``) plus zerospeed GPT's ``attn.qkv``: split per q/k/v."""
FUSED_PAIR_NAMES = ("gate_up_proj",)


@dataclass(frozen=True)
class Placement:
    """How one layer is split. ``shape``/``partition_dim`` as in ``TPLayerSpec``; ``rule`` says why."""

    kind: PartitionType
    gather_output: bool = False
    shape: tuple | None = None
    partition_dim: int | None = None
    rule: str = ""
    block: str | None = None
    """The repeated block (``nn.ModuleList`` element) holding the layer, or None."""


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a linear layer whose weight is stored ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None \
        and module.weight.dim() == 2


def is_splittable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def is_norm(key: str, module: nn.Module) -> bool:
    cls = type(module).__name__
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or key in _NORM_KEYS or cls.endswith("Norm") \
        or "RMSNorm" in cls or "LayerNorm" in cls


def model_type_of(model: nn.Module) -> str | None:
    mt = getattr(getattr(model, "config", None), "model_type", None)
    return str(mt).lower() if mt else None


def _blocks(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """Every element of every ``nn.ModuleList`` (or numbered child, as in ``nn.Sequential`` and a
    ``PipelineModule``'s layers) that is not inside another block: the repeated layers."""
    out = []
    for key, child in model.named_children():
        name = f"{prefix}{key}"
        if key.isdigit():
            out.append((name, child))
        elif isinstance(child, nn.ModuleList):
            out.extend((f"{name}.{i}", m) for i, m in enumerate(child))
        else:
            out.extend(_blocks(child, name + "."))
    return out


def _sequence(block: nn.Module, prefix: str) -> list[str | None]:
    """The block's splittable layers (full names) and norms (``None``) in registration order."""
    seq: list[str | None] = []
    for key, child in block.named_children():
        name = f"{prefix}.{key}"
        if is_splittable(child):
            seq.append(name)
        elif is_norm(key, child):
            seq.append(None)
        else:
            seq.extend(_sequence(child, name))
    return seq


def _before_norm(seq: list[str | None]) -> set[str]:
    """Linears immediately followed by a norm; cyclically, the last one when the block begins with a norm."""
    out = {seq[i - 1] for i, s in enumerate(seq) if s is None and i > 0 and seq[i - 1] is not None}
    if seq and seq[0] is None and seq[-1] is not None:
        out.add(seq[-1])
    return {s for s in out if s is not None}


def _tied_to_embedding(model: nn.Module, layer: nn.Module) -> bool:
    w = getattr(layer, "weight", None)
    return any(isinstance(m, nn.Embedding) and m.weight is w for m in model.modules())


def _from_spec(spec: TPLayerSpec) -> Placement:
    return Placement(spec.partition_type, spec.gather_output, spec.shape, spec.partition_dim,
                     rule=f"layer_specs {spec.patterns}")


def _default(name: str, mixtral: bool, row_by_norm: set[str]) -> Placement:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in _SKIP_LEAVES:
        return Placement(PartitionType.SKIP, rule="router / low-rank projection left whole")
    if leaf in _ROW_NAMES or re.search(r"(^|\.)(self_)?attention\.dense$", name) or (mixtral and leaf == "w2"):
        return Placement(PartitionType.ROW, rule="output projection")
    if name in row_by_norm:
        return Placement(PartitionType.ROW, rule="last linear before a norm")
    if any(f in name for f in FUSED_QKV_NAMES):
        return Placement(PartitionType.COLUMN, shape=(3, -1), partition_dim=0, rule="fused q/k/v")
    if leaf in FUSED_PAIR_NAMES:
        return Placement(PartitionType.COLUMN, shape=(2, -1), partition_dim=0, rule="packed gate/up")
    return Placement(PartitionType.COLUMN, rule="column (default)")


def block_names(model: nn.Module) -> list[str]:
    """The repeated blocks of ``model``, in order."""
    return [n for n, _ in _blocks(model)]


def plan_model(model: nn.Module, config: AutoTPConfig | None = None) -> dict[str, Placement]:
    """One placement per splittable layer (by module name); ValueError naming what cannot be placed."""
    mtype = model_type_of(model)
    mixtral = "mixtral" in (mtype or "") or "Mixtral" in type(model).__name__
    in_block: dict[str, str] = {}
    row_by_norm: set[str] = set()
    for bname, block in _blocks(model):
        seq = _sequence(block, bname)
        row_by_norm |= _before_norm(seq)
        in_block.update({s: bname for s in seq if s is not None})
    heads = config.lm_head_patterns if config is not None else ["lm_head", "embed_out"]
    plan: dict[str, Placement] = {}
    errors: list[str] = []
    for name, mod in model.named_modules():
        if not is_splittable(mod):
            _check_other(name, mod, config, mtype, errors)
            continue
        spec = config.find_matching_spec(name + ".weight", mtype) if config is not None else None
        if spec is not None:
            plan[name] = _from_spec(spec)
        elif config is not None and not config.use_default_specs:
            errors.append(f"{name} ({type(mod).__name__}): no layer_specs pattern matches '{name}.weight' and "
                          "use_default_specs is false")
        elif name.rsplit(".", 1)[-1] in heads:
            plan[name] = Placement(PartitionType.SKIP, rule="output head tied to an embedding") \
                if _tied_to_embedding(model, mod) else \
                Placement(PartitionType.COLUMN, gather_output=True, rule="output head (gathered)")
        elif name not in in_block:
            errors.append(f"{name} ({type(mod).__name__}): outside every repeated block (nn.ModuleList) and not "
                          f"an output head ({', '.join(heads)})")
        else:
            plan[name] = _default(name, mixtral, row_by_norm)
    plan = {n: replace(p, block=in_block.get(n)) for n, p in plan.items()}
    _check_blocks(plan, in_block, errors)
    if errors:
        raise ValueError("AutoTP cannot place these layers (add a tensor_parallel.partition_config.layer_specs "
                         "rule for each: partition_type row, column or skip):\n  " + "\n  ".join(errors))
    return plan


def _check_other(name: str, mod: nn.Module, config: AutoTPConfig | None, mtype: str | None,
                 errors: list[str]) -> None:
    """A matrix the rules have no layer for (e.g. fused 3-D expert weights): an error, never a silent replicate.
    Embeddings stay whole, as do routers."""
    if isinstance(mod, nn.Embedding) or name.rsplit(".", 1)[-1] in _SKIP_LEAVES:
        return
    for pname, p in mod.named_parameters(recurse=False):
        if getattr(p, "allreduce", True) is False:  # an expert weight: expert parallelism places it (AutoEP folding)
            continue
        spec = config.find_matching_spec(f"{name}.{pname}", mtype) if config is not None else None
        if spec is not None and spec.partition_type == PartitionType.SKIP:
            continue
        if p.dim() >= 2:
            errors.append(f"{name}.{pname} ({type(mod).__name__}, shape {tuple(p.shape)}): not a Linear/Conv1D "
                          "layer AutoTP can split (not supported yet by zerospeed)")


def _check_blocks(plan: dict[str, Placement], in_block: dict[str, str], errors: list[str]) -> None:
    """A block whose column layers no row layer closes would leave its output split across ranks."""
    kinds: dict[str, list[tuple[str, PartitionType]]] = {}
    for name, bname in in_block.items():
        if name in plan:
            kinds.setdefault(bname, []).append((name, plan[name].kind))
    for bname, members in kinds.items():
        cols = [n for n, k in members if k == PartitionType.COLUMN and not plan[n].gather_output]
        rows = [n for n, k in members if k == PartitionType.ROW]
        if cols and not rows:
            errors.append(f"{bname}: column-parallel layers {cols} but no row-parallel layer brings their "
                          "outputs back together in this block")
