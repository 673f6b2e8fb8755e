"""DeepSpeed keys zerospeed does not implement yet. This table shrinks as features land.

A listed key that is present and switched on raises ``NotSupportedYetError`` naming it; one that is
present but off (``false``, ``{"enabled": false}``, ``{"device": "none"}``, ``null``) is accepted,
since honouring "off" is not ignoring it.
"""

from __future__ import annotations

from typing import Any

from .errors import NotSupportedYetError

NOT_SUPPORTED_YET: dict[str, str] = {
    "tensor_parallel": "tensor parallelism (AutoTP)",
    "sequence_parallel_size": "sequence parallelism (Ulysses)",
    "compression_training": "compression training",
    "sparse_attention": "sparse attention",
    "elasticity": "elastic training",
    "autotuning": "the autotuner",
    "data_efficiency": "data efficiency (curriculum / random-LTD)",
    "curriculum_learning": "curriculum learning",
    "amp": "apex AMP",
    "quantize_training": "quantization-aware training",
    "nebula": "Nebula checkpointing",
    "data_types": "data_types (grad_accum_dtype)",
    "sparse_gradients": "sparse gradients",
    "disable_allgather": "disable_allgather",
    "eigenvalue": "eigenvalue computation",
    "progressive_layer_drop": "progressive layer drop",
    "hybrid_engine": "the hybrid (RLHF) engine",
    "compile": "the compile section (torch.compile of the engine)",
    "weight_quantization": "weight quantization",
    "comet": "the Comet monitor",
    "zero_optimization.cpu_offload": "ZeRO-Offload (cpu_offload)",
    "zero_optimization.zero_hpz_partition_size": "ZeRO++ hierarchical partitioning",
    "zero_optimization.zero_quantized_weights": "ZeRO++ quantized weights",
    "zero_optimization.zero_quantized_gradients": "ZeRO++ quantized gradients",
    "zero_optimization.mics_shard_size": "MiCS sharding",
    "fp16.fp16_master_weights_and_grads": "fp16 master weights and gradients",
    "bf16.immediate_grad_update": "bf16 immediate gradient update",
}

# Stage-3 options not implemented yet (the stage-3 sizes, persistence and 16-bit save keys are supported).
STAGE3_KEYS = ("stage3_module_granularity_threshold", "zeropp_loco_param", "stage3_use_all_reduce_for_fetch_params")
for _k in STAGE3_KEYS:
    NOT_SUPPORTED_YET[f"zero_optimization.{_k}"] = f"ZeRO stage 3 ({_k})"


def is_off(value: Any) -> bool:
    if value is None or value is False or value == 0:
        return True
    if isinstance(value, dict):
        if value.get("enabled") is False:
            return True
        if str(value.get("device", "")).lower() == "none":
            return True
        if not value:
            return True
    return False


def check_not_supported(raw: dict[str, Any]) -> dict[str, Any]:
    """Raise for the first not-yet-supported key that is switched on; return ``raw`` without the ones
    that are switched off (they have been honoured: the feature is off)."""
    import copy

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
        if is_off(node):
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
