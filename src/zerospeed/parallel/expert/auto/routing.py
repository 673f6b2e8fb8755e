"""AutoEP's routing keys, applied on top of the Hugging Face router that AutoEP keeps.

DeepSpeed's AutoEP replaces the router with its own (``TokenChoiceTopKRouter``) configured by these keys, "auto"
meaning the model's value. zerospeed keeps the HF router and its forward, so the keys whose meaning can be stated on
the router's output are honoured here, with DeepSpeed's formulas on the top-k weights ``w`` ``[S, k]``:

* ``top_k``: the router's ``top_k`` (and the model's ``num_experts_per_tok``, or ``top_k_attr``, which HF's
  load-balancing loss reads): the same model as HF's built with that top-k;
* ``route_norm: true``: ``w / (sum_k w + 1e-20)`` (HF's ``norm_topk_prob``); ``false`` only where the router does
  not normalise already (a Mixtral router always does: that cannot be undone);
* ``route_scale`` / ``routed_scaling_factor`` (the latter wins, as in DeepSpeed): ``w * scale``;
* ``score_apply: "pre"``: each routed token is multiplied by its weight before the experts and the outputs are
  summed unweighted (DeepSpeed's ``apply_scores_before_experts_if_enabled``); ``"post"``/``"auto"``: HF's order.

Routing that needs a router of another kind (``score_func``, ``num_expert_groups``) stays refused
(``config/unsupported.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from ....config.errors import ConfigError, NotSupportedYetError
from ....config.expert_parallel import ExpertParallelConfig
from .detect import MoEBlockSpec


@dataclass(frozen=True)
class RouteAdjust:
    """What AutoEP does to the HF router's top-k weights (identity at the defaults)."""

    normalize: bool = False
    scale: float = 1.0
    pre: bool = False

    def weights(self, w: Tensor) -> Tensor:
        if self.normalize:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scale if self.scale != 1.0 else w


def route_adjust(section: ExpertParallelConfig, model: nn.Module, specs: list[MoEBlockSpec]) -> RouteAdjust:
    """Check the routing keys against the model and set its top-k; the weight adjustment for every block."""
    if isinstance(section.top_k, int):
        set_top_k(model, specs, section.top_k, section.top_k_attr or "num_experts_per_tok")
    if section.route_norm is False:
        for spec in specs:
            if getattr(model.get_submodule(spec.name).get_submodule(spec.router), "norm_topk_prob", True):
                raise NotSupportedYetError("expert_parallel.route_norm", f"false, but the router of {spec.name!r} "
                                           "normalises its top-k weights itself (a Mixtral router always does; "
                                           "norm_topk_prob true); AutoEP keeps the HF router, so that is not "
                                           "supported yet by zerospeed. Remove the key or use true")
    scale = section.route_scale
    if section.routed_scaling_factor != "auto":
        if getattr(getattr(model, "config", None), "routed_scaling_factor", None) is not None:
            raise NotSupportedYetError("expert_parallel.routed_scaling_factor", "the model's config has its own "
                                       "routed_scaling_factor, which its HF router applies; overriding it is not "
                                       "supported yet by zerospeed (remove the key)")
        scale = float(section.routed_scaling_factor)
    return RouteAdjust(normalize=bool(section.route_norm), scale=scale, pre=section.score_apply == "pre")


def set_top_k(model: nn.Module, specs: list[MoEBlockSpec], k: int, attr: str) -> None:
    """Every router's ``top_k`` (and its block's), and the model's attribute HF's load-balancing loss reads."""
    for spec in specs:
        if not 1 <= k <= spec.num_experts:
            raise ConfigError("expert_parallel.top_k", f"{k} must be between 1 and the {spec.num_experts} experts "
                              f"of {spec.name!r}")
        block = model.get_submodule(spec.name)
        router = block.get_submodule(spec.router)
        if not isinstance(getattr(router, "top_k", None), int):
            raise ConfigError("expert_parallel.top_k", f"the router of {spec.name!r} ({type(router).__name__}) has no "
                              "integer top_k attribute to set; remove the key")
        router.top_k = k
        if isinstance(getattr(block, "top_k", None), int):
            block.top_k = k
    for module in model.modules():  # e.g. MixtralForCausalLM.num_experts_per_tok (the aux loss's top-k)
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, k)
    config = getattr(model, "config", None)
    if config is not None and isinstance(getattr(config, attr, None), int):
        setattr(config, attr, k)
