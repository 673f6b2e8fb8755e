"""The kept Hugging Face router as AutoEP's routing keys see it: what it does, and the knobs HF gives it.

Every transformers 5 MoE router is ``router(h) -> (logits, top-k weights, top-k indices)``; they differ in::

    family        scores   group limit (choice of experts)                 top-k norm       scale
    Mixtral       softmax  none                                            always           none
    Qwen2/3-MoE   softmax  none                                            norm_topk_prob   none
    DeepSeek-V2   softmax  topk_method "group_limited_greedy": num_group   never            routed_scaling_factor
                           groups scored by their best expert, topk_group
                           kept (greedy: none)
    DeepSeek-V3   sigmoid  always: groups scored by their top-2 sum of     norm_topk_prob   routed_scaling_factor
                           (score + e_score_correction_bias), topk_group
                           kept; the bias steers the choice only

Those are DeepSpeed's ``TokenChoiceTopKRouter`` formulas with its DeepSeek presets' settings (group score ``max``
for V2, ``top2_sum`` for V3), so a key that sets one of these knobs means the same model as HF's built with that
config field, and the same as DeepSpeed's router. A key the router has no knob for is refused (``NotSupportedYetError``).
"""

from __future__ import annotations

from torch import nn

from ....config.errors import ConfigError, NotSupportedYetError


def score_func(router: nn.Module) -> str:
    """The router's score function: ``sigmoid`` for a DeepSeek-V3-style router (it has a score-correction bias)."""
    return "sigmoid" if hasattr(router, "e_score_correction_bias") else "softmax"


def normalises(router: nn.Module) -> bool:
    """Whether the router divides its top-k weights by their sum (DeepSeek-V2's, with ``topk_method``, never does)."""
    if isinstance(getattr(router, "norm_topk_prob", None), bool):
        return router.norm_topk_prob
    return not hasattr(router, "topk_method")


def check_score_func(value: str, name: str, router: nn.Module) -> None:
    own = score_func(router)
    if value not in ("auto", own):
        raise NotSupportedYetError("expert_parallel.score_func", f"{value!r}, but the router of {name!r} "
                                   f"({type(router).__name__}) scores with {own}; AutoEP keeps the HF router, so "
                                   f"another score function is not supported yet by zerospeed (use 'auto' or {own!r})")


def set_groups(name: str, router: nn.Module, groups: int | None, limited: int | None) -> None:
    """``num_expert_groups`` / ``num_limited_groups`` as the router's ``num_group`` / ``topk_group`` (HF's
    ``n_group`` / ``topk_group``); the one not given keeps the model's value."""
    key = "expert_parallel.num_expert_groups" if groups is not None else "expert_parallel.num_limited_groups"
    if not hasattr(router, "num_group") or not hasattr(router, "topk_group"):
        raise NotSupportedYetError(key, f"the router of {name!r} ({type(router).__name__}) has no group limit (only "
                                   "DeepSeek-V2/V3 routers have one: num_group, topk_group); AutoEP keeps the HF "
                                   "router, so group-limited routing is not supported yet by zerospeed on it")
    if getattr(router, "topk_method", "group_limited_greedy") != "group_limited_greedy":
        raise NotSupportedYetError(key, f"the router of {name!r} has topk_method {router.topk_method!r}, which "
                                   "ignores groups; group-limited routing on it would be DeepSpeed's top-2-sum group "
                                   "score, which HF's DeepSeek-V2 router does not have (its group_limited_greedy "
                                   "scores a group by its best expert): set topk_method 'group_limited_greedy' in the "
                                   "model's config instead")
    g = groups if groups is not None else router.num_group
    k = limited if limited is not None else router.topk_group
    experts = router.num_experts
    if g is None or k is None:
        raise ConfigError(key, f"the router of {name!r} has no {'num_group' if g is None else 'topk_group'} "
                          "in its config; set both num_expert_groups and num_limited_groups")
    if experts % g:
        raise ConfigError("expert_parallel.num_expert_groups", f"{g} does not divide the {experts} experts of "
                          f"{name!r}; valid: {[d for d in range(1, experts + 1) if experts % d == 0]}")
    if not 1 <= k <= g:
        raise ConfigError("expert_parallel.num_limited_groups", f"{k} must be between 1 and the {g} expert groups")
    if score_func(router) == "sigmoid" and experts // g < 2:
        raise ConfigError("expert_parallel.num_expert_groups", f"{g} groups leave {experts // g} expert per group "
                          f"in {name!r}; a DeepSeek-V3 router scores a group by its top-2 experts (at least 2)")
    if router.top_k > k * (experts // g):
        raise ConfigError(key, f"top-{router.top_k} routing of {name!r} needs at least {router.top_k} experts in "
                          f"the {k} chosen groups of {experts // g}")
    router.num_group, router.topk_group = g, k
