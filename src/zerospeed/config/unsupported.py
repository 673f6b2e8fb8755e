"""DeepSpeed keys zerospeed does not implement yet. This table shrinks as features land.

A listed key that is present and switched on raises ``NotSupportedYetError`` naming it; one that is
present but off (``false``, ``{"enabled": false}``, ``{"device": "none"}``, ``null``, an object whose
values are all off) is accepted, since honouring "off" is not ignoring it. A few keys are "off" at a
value of their own (``ACCEPTED_VALUES``: ``zero_optimization.offload_optimizer.cpuadam_cores_perc: 0.8``,
DeepSpeed's default; ...).
"""

from __future__ import annotations

import copy
from typing import Any

from .errors import NotSupportedYetError

NOT_SUPPORTED_YET: dict[str, str] = {
    "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule": "random-LTD's layer-token learning-rate "
                                                                      "schedule (DeepSpeed raises too)",
    "amp": ("apex AMP (DeepSpeed's amp section hands the model to NVIDIA apex's amp.initialize, a CUDA-only extension "
            "zerospeed does not build on; torch_autocast or the fp16/bf16 sections give the same mixed precision "
            "through PyTorch)"),
    "hybrid_engine.enable_cuda_graph": "CUDA graphs in the hybrid engine (enable_cuda_graph: they need a CUDA device, "
                                       "so never on CPU; on CUDA zerospeed has no captured decode yet)",
}

# The compile section's keys not built yet (config/compile.py; DeepCompile itself, its passes, debug_log,
# free_activation(_threshold), the sync_* keys, symmetric_memory and the three offload passes are built:
# runtime/deepcompile.py, runtime/deepcompile_offload.py, zero/stage3/graph_offload.py, comm/symmetric.py;
# autoep_non_moe: runtime/compile.py): none left.
DEEPCOMPILE_KEYS: tuple[str, ...] = ()

# AutoEP keeps the HF model's own router (parallel/expert/auto/): route_norm, route_scale, routed_scaling_factor,
# top_k, score_apply, score_func and the group keys are applied to it or checked against it (auto/routing.py,
# auto/hf_router.py, which refuse what the model's router cannot do); these are refused by DeepSpeed too, or are
# a debug order, and are accepted at their defaults only.
AUTOEP_ROUTING_KEYS: dict[str, tuple[Any, ...]] = {
    "combine_impl": (None, "auto", "weighted_sum"), "load_balance_coeff": (None,),
    "expert_tensor_parallel_size": (None, 1),
}
_AUTOEP_REASONS = {
    "combine_impl": "combine_impl 'legacy_bmm' (DeepSpeed's debug reduction order; zerospeed's is 'weighted_sum')",
    "load_balance_coeff": "AutoEP's auxiliary-loss-free load balancing (load_balance_coeff; DeepSpeed refuses it too)",
    "expert_tensor_parallel_size": "AutoEP expert tensor parallelism (expert_tensor_parallel_size > 1; DeepSpeed "
                                   "refuses it too)",
}
for _k in AUTOEP_ROUTING_KEYS:
    NOT_SUPPORTED_YET[f"expert_parallel.{_k}"] = _AUTOEP_REASONS[_k]

# Keys whose "off" is a value of their own: only these values (and null) are accepted.
ACCEPTED_VALUES: dict[str, tuple[Any, ...]] = {
    **{f"expert_parallel.{k}": v for k, v in AUTOEP_ROUTING_KEYS.items()},
}


def is_off(value: Any) -> bool:
    if value is None or value is False or value == 0:
        return True
    if isinstance(value, dict):
        if value.get("enabled") is False:
            return True
        if str(value.get("device", "")).lower() == "none":
            return True
        return all(is_off(v) or v == [] for v in value.values())
    return False


def _same(a: Any, b: Any) -> bool:
    """Equal, without ``True == 1``."""
    return a is b if isinstance(a, bool) or isinstance(b, bool) else a == b


def _accepted(path: str, value: Any) -> bool:
    if path in ACCEPTED_VALUES:
        return any(_same(value, v) for v in ACCEPTED_VALUES[path])
    return is_off(value)


def check_not_supported(raw: dict[str, Any]) -> dict[str, Any]:
    """Raise for the first not-yet-supported key that is switched on; return ``raw`` without the ones
    that are switched off (they have been honoured: the feature is off)."""
    cleaned = copy.deepcopy(raw)
    for path, feature in NOT_SUPPORTED_YET.items():
        node: Any = raw
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                node = _MISSING
                break
            node = node[part]
        if node is _MISSING:
            continue
        if _accepted(path, node):
            *parents, leaf = path.split(".")
            parent: Any = cleaned
            for part in parents:
                parent = parent[part]
            parent.pop(leaf, None)
            continue
        raise NotSupportedYetError(path, f"{feature} is not supported yet by zerospeed (value {node!r}). "
                                         "Remove the key or switch it off.")
    return cleaned


_MISSING = object()
