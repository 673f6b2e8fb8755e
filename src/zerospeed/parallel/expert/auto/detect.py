"""Finding the MoE blocks of a Hugging Face model by their structure (pure: reads modules, changes nothing).

An MoE block is a module with two children: a *router* holding a 2-D ``weight`` ``[E, H]`` and the
*experts* holding the stacked ("fused 3-D") weights every recent HF MoE model uses::

    experts.<w1>   [E, 2I, H]   gate and up projections concatenated (w3 absent)   -- or [E, I, H] with
    experts.<w3>   [E, I, H]    a separate up projection
    experts.<w2>   [E, H, I]    down projection
    experts.act_fn              the activation between them (SiLU for Mixtral / Qwen-MoE)

so ``y_e(x) = (act(x W1g^T) * x W1u^T) W2^T``. Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3
(transformers 5; DeepSeek's dense first layers have no router and are skipped) all have this shape under the names ``gate`` / ``experts`` / ``gate_up_proj`` / ``down_proj``. User keys of the
``expert_parallel`` section (``moe_layer_pattern``, ``router_pattern``, ``expert_pattern``, ``expert_w1`` ...)
take precedence over these defaults; a preset only fixes the defaults for its family.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from ....config.expert_parallel import ExpertParallelConfig

_DEFAULTS = {"router": "gate", "experts": "experts", "w1": "gate_up_proj", "w2": "down_proj", "w3": None}
_PRESET_LAYER = {"mixtral": r"(.*\.)?layers\.\d+\.mlp", "qwen2_moe": r"(.*\.)?layers\.\d+\.mlp",
                 "qwen3_moe": r"(.*\.)?layers\.\d+\.mlp", "deepseek_v2": r"(.*\.)?layers\.\d+\.mlp",
                 "deepseek_v3": r"(.*\.)?layers\.\d+\.mlp"}


@dataclass(frozen=True)
class MoEBlockSpec:
    """One detected MoE block: where its router and experts are and the experts' weight names and sizes."""

    name: str
    router: str
    experts: str
    w1: str
    w2: str
    w3: str | None
    num_experts: int
    hidden: int
    intermediate: int


def _names(cfg: ExpertParallelConfig) -> dict[str, Any]:
    names = dict(_DEFAULTS)
    for key, field in (("router", "router_pattern"), ("experts", "expert_pattern"), ("w1", "expert_w1"),
                       ("w2", "expert_w2")):
        if getattr(cfg, field) is not None:
            names[key] = getattr(cfg, field)
    if cfg.expert_w3 is not None:
        names["w3"] = cfg.expert_w3
    return names


def _spec(name: str, block: nn.Module, names: dict[str, Any]) -> MoEBlockSpec | None:
    router = getattr(block, names["router"], None)
    experts = getattr(block, names["experts"], None)
    if not isinstance(router, nn.Module) or not isinstance(experts, nn.Module):
        return None
    w1, w2 = getattr(experts, names["w1"], None), getattr(experts, names["w2"], None)
    w3 = getattr(experts, names["w3"], None) if names["w3"] else None
    rw = getattr(router, "weight", None)
    if not all(isinstance(t, nn.Parameter) for t in (w1, w2, rw)) or w1.dim() != 3 or w2.dim() != 3 or rw.dim() != 2:
        return None
    e, h, i = w2.shape
    gate_rows = i if w3 is not None else 2 * i
    if tuple(w1.shape) != (e, gate_rows, h) or tuple(rw.shape) != (e, h):
        return None
    if w3 is not None and tuple(w3.shape) != (e, i, h):
        return None
    if not callable(getattr(experts, "act_fn", None)):
        return None
    return MoEBlockSpec(name, names["router"], names["experts"], names["w1"], names["w2"], names["w3"], e, h, i)


def find_moe_blocks(model: nn.Module, cfg: ExpertParallelConfig) -> list[MoEBlockSpec]:
    """Every MoE block of ``model`` (in module order), under the section's names and layer pattern."""
    names = _names(cfg)
    pattern = cfg.moe_layer_pattern or (_PRESET_LAYER[cfg.preset_model] if cfg.preset_model else None)
    regex = re.compile(pattern) if pattern else None
    found = []
    for name, module in model.named_modules():
        if regex is not None and not regex.fullmatch(name):
            continue
        spec = _spec(name, module, names)
        if spec is not None:
            found.append(spec)
    return found
