"""AutoEP's routing keys, applied on top of the Hugging Face router that AutoEP keeps.

DeepSpeed's AutoEP replaces the router with its own (``TokenChoiceTopKRouter``) configured by these keys, "auto"
meaning the model's value. zerospeed keeps the HF router and its forward, so the keys whose meaning can be stated on
the router's output are honoured here, with DeepSpeed's formulas on the top-k weights ``w`` ``[S, k]``:

* ``top_k``: the router's ``top_k`` (and the model's ``num_experts_per_tok``, or ``top_k_attr``, which HF's
  load-balancing loss reads): the same model as HF's built with that top-k;
* ``route_norm``: the router's ``norm_topk_prob`` where it has one (Qwen-MoE, DeepSeek-V3); ``true`` elsewhere:
  ``w / (sum_k w + 1e-20)`` (then times the router's scale: DeepSeek-V2); ``false`` only where the router does not
  normalise already (a Mixtral router always does: that cannot be undone);
* ``route_scale`` / ``routed_scaling_factor`` (the latter wins, as in DeepSpeed): ``w * scale``; on a router that
  scales itself (DeepSeek), ``routed_scaling_factor`` sets its factor and ``route_scale`` yields to it (DeepSpeed's
  rule, with its warning);
* ``score_apply: "pre"``: each routed token is multiplied by its weight before the experts and the outputs are
  summed unweighted (DeepSpeed's ``apply_scores_before_experts_if_enabled``); ``"post"``/``"auto"``: HF's order.

``score_func``, ``num_expert_groups`` and ``num_limited_groups`` are checked against, or set on, the router's own
knobs (``hf_router.py``: DeepSeek-V2/V3 routers limit experts by group); where the router has no such knob, refused.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch import Tensor, nn

from ....config.errors import ConfigError, NotSupportedYetError
from ....config.expert_parallel import ExpertParallelConfig
from . import hf_router
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
    """Check the routing keys against the model and set the router knobs HF has (``hf_router.py``: top-k, groups,
    top-k normalisation, routed scaling); the weight adjustment left for every block."""
    if isinstance(section.top_k, int):
        set_top_k(model, specs, section.top_k, section.top_k_attr or "num_experts_per_tok")
    routers = [(spec.name, model.get_submodule(spec.name).get_submodule(spec.router)) for spec in specs]
    for name, router in routers:
        hf_router.check_score_func(section.score_func, name, router)
        if section.num_expert_groups is not None or section.num_limited_groups is not None:
            hf_router.set_groups(name, router, section.num_expert_groups, section.num_limited_groups)
    config = getattr(model, "config", None)
    own_scale = [r for _, r in routers if isinstance(getattr(r, "routed_scaling_factor", None), (int, float))]
    if own_scale:  # DeepSeek: the router scales itself; the key sets that factor, route_scale yields to it
        return _own_scale(section, routers, own_scale, config)
    scale = section.route_scale
    if section.routed_scaling_factor != "auto":
        if getattr(config, "routed_scaling_factor", None) is not None:
            raise NotSupportedYetError("expert_parallel.routed_scaling_factor", "the model's config has its own "
                                       "routed_scaling_factor, which its HF router applies; overriding it is not "
                                       "supported yet by zerospeed (remove the key)")
        scale = float(section.routed_scaling_factor)
    return RouteAdjust(normalize=_route_norm(section.route_norm, routers, config), scale=scale,
                       pre=section.score_apply == "pre")


def _own_scale(section: ExpertParallelConfig, routers: list[tuple[str, nn.Module]], own: list[nn.Module],
               config: object) -> RouteAdjust:
    """Routers that apply ``routed_scaling_factor`` themselves (DeepSeek): the key sets it (DeepSpeed: it wins);
    ``route_scale`` is overridden by the model's factor, as in DeepSpeed (with its warning)."""
    if section.routed_scaling_factor != "auto":
        for router in own:
            router.routed_scaling_factor = float(section.routed_scaling_factor)
        if config is not None and getattr(config, "routed_scaling_factor", None) is not None:
            config.routed_scaling_factor = float(section.routed_scaling_factor)
    elif section.route_scale != 1.0:
        warnings.warn(f"expert_parallel.route_scale {section.route_scale} is overridden by the model's "
                      f"routed_scaling_factor {own[0].routed_scaling_factor} (as in DeepSpeed); set "
                      "routed_scaling_factor to change it", stacklevel=3)
    normalize = _route_norm(section.route_norm, routers, config)
    # a router that never normalises (DeepSeek-V2) scaled its weights already: normalising them drops the factor,
    # so it is put back (DeepSpeed's order: normalise, then scale)
    scale = float(own[0].routed_scaling_factor) if normalize else 1.0
    return RouteAdjust(normalize=normalize, scale=scale, pre=section.score_apply == "pre")


def _route_norm(value: bool | None, routers: list[tuple[str, nn.Module]], config: object) -> bool:
    """``route_norm``: set as the router's ``norm_topk_prob`` where it has one (Qwen-MoE, DeepSeek-V3); honoured
    where the router already does the same; True on a router that never normalises (DeepSeek-V2): normalise its
    weights here (the returned flag); False on one that always does (Mixtral): refused."""
    if value is None:
        return False
    adjust = False
    for name, router in routers:
        if isinstance(getattr(router, "norm_topk_prob", None), bool):
            router.norm_topk_prob = value
            if config is not None and isinstance(getattr(config, "norm_topk_prob", None), bool):
                config.norm_topk_prob = value
        elif hf_router.normalises(router) != value:
            if not value:
                raise NotSupportedYetError("expert_parallel.route_norm", f"false, but the router of {name!r} "
                                           "normalises its top-k weights itself (a Mixtral router always does); "
                                           "AutoEP keeps the HF router, so that is not supported yet by zerospeed. "
                                           "Remove the key or use true")
            adjust = True
    return adjust


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
