"""The ``expert_parallel`` section: AutoEP, expert parallelism for Hugging Face MoE models from the config alone.

DeepSpeed's keys (master, 2026). zerospeed keeps the model's own router module and MoE block forward, and
replaces only the experts' computation (``parallel/expert/auto/``). ``top_k``, ``route_norm``, ``route_scale``,
``routed_scaling_factor``, ``score_apply``, ``score_func``, ``num_expert_groups`` and ``num_limited_groups`` are
applied to (or checked against) the HF router (``auto/routing.py``, ``auto/hf_router.py``); the keys below are
read (``combine_impl: legacy_bmm``, ``load_balance_coeff`` and ``expert_tensor_parallel_size`` > 1 are refused as
"not supported yet": ``unsupported.AUTOEP_ROUTING_KEYS``):

* ``enabled``, ``autoep_size`` (the expert-parallel degree; 1 keeps every expert local, no all-to-all);
* detection: ``preset_model`` (``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``deepseek_v2``, ``deepseek_v3``), ``moe_layer_pattern`` (a regex
  over module names), ``router_pattern`` / ``expert_pattern`` (child names), ``expert_w1`` / ``expert_w2`` /
  ``expert_w3`` (the experts' 3-D weights; ``expert_w3: null`` = gate and up fused in ``expert_w1``),
  ``num_experts_attr`` (a hint: the count comes from the weights); user values take precedence over the
  structural detection;
* routing (``auto/routing.py``): ``top_k`` (with ``top_k_attr``, the model attribute HF's load-balancing loss
  reads, default ``num_experts_per_tok``), ``route_norm``, ``route_scale``, ``routed_scaling_factor``,
  ``score_apply``, ``score_func``, ``num_expert_groups``, ``num_limited_groups``; ``validate_folding_routing`` (AutoEP + AutoTP: compare the tensor ranks' routes);
* compute: ``use_grouped_mm`` (``torch._grouped_mm`` where it runs, a per-expert loop otherwise);
  ``disable_triton_grouped_mm`` is a hint (zerospeed has no Triton kernel).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from .base import Section

PRESETS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")


class ExpertParallelConfig(Section):
    """DeepSpeed's ``AutoEPConfig`` keys and defaults."""

    enabled: bool = False
    autoep_size: int = Field(1, ge=1)
    """Expert-parallel ranks; must divide the data-parallel world size and every layer's expert count."""
    expert_tensor_parallel_size: int = Field(1, ge=1)
    validate_folding_routing: bool = False
    preset_model: str | None = None
    moe_layer_pattern: str | None = None
    expert_pattern: str | None = None
    router_pattern: str | None = None
    use_grouped_mm: bool = True
    disable_triton_grouped_mm: bool = False
    route_norm: bool | None = None
    route_scale: float = 1.0
    score_apply: Literal["auto", "pre", "post"] = "auto"
    combine_impl: Literal["auto", "weighted_sum", "legacy_bmm"] = "auto"
    num_expert_groups: int | None = Field(None, ge=1)
    """Group-limited routing (DeepSeek-V2/V3 routers: their ``n_group``); refused on a router without groups."""
    num_limited_groups: int | None = Field(None, ge=1)
    """Groups each token may use (the router's ``topk_group``)."""
    score_func: Literal["auto", "softmax", "sigmoid"] = "auto"
    """Must be the kept router's own (sigmoid for DeepSeek-V3, softmax for the others); another is refused."""
    top_k: int | Literal["auto"] = "auto"
    load_balance_coeff: float | None = None
    routed_scaling_factor: float | Literal["auto"] = "auto"
    expert_w1: str | None = None
    expert_w2: str | None = None
    expert_w3: str | None = None
    """Absent or ``null``: gate and up fused in ``expert_w1`` (HF's layout); a name: a separate up weight."""
    num_experts_attr: str | None = None
    top_k_attr: str | None = None
    has_shared_experts: bool | None = None
    shared_experts_pattern: str | None = None
    shared_experts_gate_pattern: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"top_k must be >= 1 or 'auto', got {v}")
        return v

    @field_validator("preset_model")
    @classmethod
    def _preset(cls, v: str | None) -> str | None:
        if v is not None and v not in PRESETS:
            raise ValueError(f"unknown preset_model {v!r}; available presets: {list(PRESETS)}")
        return v

    @field_validator("expert_w1", "expert_w2", "expert_w3", "router_pattern", "expert_pattern")
    @classmethod
    def _attr_name(cls, v: str | None) -> str | None:
        if v is not None and (not v or "." in v):
            raise ValueError(f"{v!r} must be a direct attribute name (non-empty, no dots)")
        return v
