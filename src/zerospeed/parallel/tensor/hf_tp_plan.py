"""A Hugging Face model's own tensor-parallel plan (``tp_plan``), read and turned into AutoTP rules.

transformers models name how their layers split: ``config.base_model_tp_plan`` (patterns relative to the base
model, ``layers.*.self_attn.q_proj: colwise``), the model class's ``_tp_plan`` (entries such as ``lm_head``) and
an instance's ``_tp_plan`` (transformers may replace it by the base plan with ``model.``-prefixed patterns).
``hf_tp_plan(model)`` merges the three in that order; an instance entry ``model.X`` whose ``X`` is already
there adds nothing. An empty merge is None.

``specs_from_hf_plan(plan)`` turns the plan into ``TPLayerSpec`` rules (``*`` any characters, a pattern
matched at the end of a parameter name, ``.weight`` added): ``colwise`` is column, ``colwise_rep`` /
``colwise_gather_output`` column with a gathered output, ``rowwise`` row, ``replicated_with_grad_allreduce``
left whole. A plan with any other style gives None (it cannot be applied in part: half of a column/row pair
would be cut), and AutoTP then uses its built-in rules. DeepSpeed 0.19.8 raises there instead.

AutoTP's order (``model_init.autotp_shard``), as DeepSpeed's: the user's ``partition_config`` or
``preset_model``, else the model's plan, else the built-in rules; layers the plan does not name follow the
built-in rules.
"""

from __future__ import annotations

import re
from typing import Any

from .autotp_config import AutoTPConfig, PartitionType, TPLayerSpec

_COLUMN = {"colwise": False, "colwise_rep": True, "colwise_gather_output": True}  # style -> gather_output
STYLES = (*_COLUMN, "rowwise", "replicated_with_grad_allreduce")


def hf_tp_plan(model: Any) -> dict[str, str] | None:
    """The merged plan of ``model`` (see the module docstring), or None when it has none."""
    config = getattr(model, "config", None)
    sources = (getattr(config, "base_model_tp_plan", None) if config is not None else None,
               getattr(type(model), "_tp_plan", None),
               getattr(model, "__dict__", {}).get("_tp_plan"))
    merged: dict[str, str] = {}
    seen: set[str] = set()
    for plan in sources:
        for pattern, style in (plan.items() if isinstance(plan, dict) else ()):
            bare = pattern.removeprefix("model.")
            if bare != pattern and bare in seen:
                continue
            merged[pattern] = style
            seen.add(bare)
    return merged or None


def _regex(pattern: str) -> str:
    body = ".*" + re.escape(pattern).replace(r"\*", ".*")
    return body + ("$" if body.endswith(r"\.weight") else r"\.weight$")


def specs_from_hf_plan(plan: dict[str, str] | None) -> list[TPLayerSpec] | None:
    """AutoTP rules for ``plan``; None when it is empty or names a style outside ``STYLES``."""
    if not plan or any(style.lower() not in STYLES for style in plan.values()):
        return None
    specs = []
    for pattern, style in plan.items():
        s = style.lower()
        if s in _COLUMN:
            specs.append(TPLayerSpec([_regex(pattern)], PartitionType.COLUMN, gather_output=_COLUMN[s]))
        elif s == "rowwise":
            specs.append(TPLayerSpec([_regex(pattern)], PartitionType.ROW))
        else:
            specs.append(TPLayerSpec([_regex(pattern)], PartitionType.SKIP, grad_allreduce=True))
    return specs


def plan_config(model: Any, tp_size: int) -> AutoTPConfig | None:
    """The AutoTP configuration the model's own plan gives (None: no usable plan; the built-in rules apply)."""
    specs = specs_from_hf_plan(hf_tp_plan(model))
    return None if specs is None else AutoTPConfig(tp_size=tp_size, layer_specs=specs, use_default_specs=True)


_get_hf_tp_plan = hf_tp_plan  # DeepSpeed's name (deepspeed.runtime.tensor_parallel.config)
