"""``zero_optimization.leaf_module``: the modules ZeRO-3 gathers whole (zero/stage3/leaves.py)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from .base import Section

# DeepSpeed's defaults: Hugging Face's sparse MoE blocks (kept in one place: zero/stage3/leaves.py reads these).
DEFAULT_LEAF_MODULE_CLASSES: tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


class LeafModuleConfig(Section):
    """Leaf modules by class (short or fully qualified name), by ``named_modules()`` name, or by name suffix.

    A single string counts as a one-element list; duplicates are dropped (as in DeepSpeed).
    """

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: list[str] = Field(default_factory=list)
    name_suffixes: list[str] = Field(default_factory=list)

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _listed(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [v]
        if isinstance(v, (list, tuple)):
            return list(dict.fromkeys(str(x) for x in v))
        return v
