"""DeepSpeed keys zerospeed does not implement yet. This table shrinks as features land.

A listed key that is present and switched on raises ``NotSupportedYetError`` naming it; one that is
present but off (``false``, ``{"enabled": false}``, ``{"device": "none"}``, ``null``, an object whose
values are all off) is accepted, since honouring "off" is not ignoring it. A few keys are "off" at a
value of their own (``ACCEPTED_VALUES``: ``seq_parallel_communication_data_type: "fp32"``, DeepSpeed's
default; ``gradient_allreduce_op: "mean"``, what zerospeed always does; ...).
"""

from __future__ import annotations

import copy
from typing import Any

from .errors import NotSupportedYetError

NOT_SUPPORTED_YET: dict[str, str] = {
    "seq_parallel_communication_data_type": "the sequence-parallel communication dtype",
    "expert_parallel": "expert parallelism (AutoEP)",
    "data_efficiency.data_sampling.dynamic_batching": "dynamic batching with learning-rate scaling",
    "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule": "random-LTD's layer-token learning-rate "
                                                                      "schedule (DeepSpeed raises too)",
    "amp": "apex AMP",
    "torch_autocast": "torch autocast mixed precision (torch_autocast)",
    "graph_harvesting": "graph harvesting (CUDA graphs)",
    "managed_gradient_accumulation": "client-managed gradient accumulation (managed_gradient_accumulation: false)",
    "gradient_allreduce_op": "a gradient all-reduce op other than 'mean'",
    "nebula": "Nebula checkpointing",
    "datastates_ckpt": "DataStates checkpointing",
    "data_types.grad_accum_dtype": "data_types.grad_accum_dtype (the gradient accumulation dtype)",
    "sparse_gradients": "sparse gradients",
    "disable_allgather": "disable_allgather",
    "hybrid_engine": "the hybrid (RLHF) engine",
    "weight_quantization.quantized_initialization": "zero.Init's quantized initialization "
                                                    "(weight_quantization.quantized_initialization)",
    "comet": "the Comet monitor",
    "timers": "the timers section (throughput timer options)",
    "log_level": "log_level (DeepSpeed's logger level)",
    "checkpoint.parallel_write": "pipeline-stage parallel checkpoint writes (checkpoint.parallel_write)",
    "checkpoint.writer": "DeepSpeed's checkpoint writers (checkpoint.writer)",
    "checkpoint.checkpoint_serialization": "torch's legacy checkpoint serialization (checkpoint_serialization: false)",
    "zero_optimization.zenflow.pt_reserved_cores_perc": "pt_reserved_cores_perc (the core split of DeepSpeed's "
                                                         "ZenFlow optimizer process)",
    "zero_optimization.mics_shard_size": "MiCS sharding",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS hierarchical parameter gathering",
    "zero_optimization.legacy_stage1": "the legacy ZeRO stage 1",
    "zero_optimization.pipeline_loading_checkpoint": "pipeline-mode checkpoint loading under stage 3",
    "zero_optimization.override_module_apply": "zero.Init overriding nn.Module.apply",
    "zero_optimization.enable_sanity_checks": "ZeRO internal sanity checks",
    "zero_optimization.leaf_module": "ZeRO-3 leaf modules",
    "zero_optimization.offload_optimizer.super_offload": "SuperOffload",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": "cpuadam_cores_perc (DeepSpeedCPUAdam's core share)",
    "fp16.fp16_master_weights_and_grads": "fp16 master weights and gradients",
    "bf16.bf16_master_weights_and_grads": "bf16 master weights and gradients",
    "bf16.bf16_optimizer_states": "bf16 optimizer states",
    "bf16.immediate_grad_update": "bf16 immediate gradient update",
}

# Stage-3 options not implemented yet (the stage-3 sizes, persistence and 16-bit save keys are supported).
STAGE3_KEYS = ("stage3_module_granularity_threshold", "zeropp_loco_param", "stage3_use_all_reduce_for_fetch_params",
               "stage3_allgather_sequential")
for _k in STAGE3_KEYS:
    NOT_SUPPORTED_YET[f"zero_optimization.{_k}"] = f"ZeRO stage 3 ({_k})"

# The compile section's DeepCompile keys (config/compile.py): accepted at their defaults only. Plain
# torch.compile (engine.compile()) reads none of them, in DeepSpeed as here.
DEEPCOMPILE_KEYS = ("deepcompile", "autoep_non_moe", "free_activation", "free_activation_threshold",
                    "offload_activation", "offload_activation_pin_memory", "offload_opt_states", "double_buffer",
                    "symmetric_memory", "debug_log", "offload_parameters", "sync_before_reduce", "sync_after_reduce",
                    "sync_before_allgather", "sync_after_allgather", "keep_int_input_tensors",
                    "keep_all_input_tensors", "passes")
for _k in DEEPCOMPILE_KEYS:
    NOT_SUPPORTED_YET[f"compile.{_k}"] = ("DeepCompile" if _k == "deepcompile" else
                                         "AutoEP regional compile" if _k == "autoep_non_moe" else f"DeepCompile's {_k}")

# Keys whose "off" is a value of their own: only these values (and null) are accepted.
ACCEPTED_VALUES: dict[str, tuple[Any, ...]] = {
    "seq_parallel_communication_data_type": (None, "fp32", "float32"),
    "managed_gradient_accumulation": (None, True),
    "gradient_allreduce_op": (None, "mean"),
    "checkpoint.checkpoint_serialization": (None, True),
    "zero_optimization.mics_shard_size": (None, -1),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": (None, 0.8),
    "zero_optimization.zenflow.pt_reserved_cores_perc": (None, 0.5),
    "compile.free_activation_threshold": (None, 10 * 1024 * 1024),
    "compile.offload_activation_pin_memory": (None, True),
    "compile.double_buffer": (None, True),
    "compile.keep_int_input_tensors": (None, True),
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
