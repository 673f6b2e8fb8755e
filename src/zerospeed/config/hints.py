"""DeepSpeed keys accepted as hints: pure performance switches whose effect zerospeed's design always has.

Every other key of the schema is read by code with DeepSpeed's meaning (``tests/unit/test_config_schema.py``
walks the schema to keep it so). A key is listed here only when every value it can take gives the same
results in zerospeed; the reason says why. When a config sets one, rank 0 logs one line per key at
start-up (a warning when the value differs from DeepSpeed's default, else info), so nobody believes a
switch did something it did not.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

ACCEPTED_HINTS: dict[str, str] = {
    "compile.double_buffer": (
        "DeepCompile's double buffering of gradient reductions: zerospeed's reducer always keeps at most two "
        "bucket collectives in flight (zero/grad_reducer.py MAX_IN_FLIGHT), which is what true asks for; the "
        "values are the same either way"),
    "compile.keep_int_input_tensors": (
        "which real input values DeepSpeed's profiling runs keep (InputStorage); zerospeed plans its DeepCompile "
        "passes at compile time and re-runs no graph to profile it, so no inputs are stored whatever it says"),
    "compile.keep_all_input_tensors": (
        "as compile.keep_int_input_tensors: inputs kept for DeepSpeed's profiling runs, which zerospeed does not make"),
    "nebula.enable_nebula_load": (
        "whether DeepSpeed loads through the Nebula service or torch.load; zerospeed's tiered checkpoints are the "
        "same committed files either way, which load_checkpoint reads; the loaded state is the same either way"),
    "autotuning.model_info.hidden_size": (
        "DeepSpeed's tuner reports it with the model info; zerospeed's memory pruning uses the measured "
        "parameter count, and the micro-batch ascent finds the activation limit by running (it stops at the "
        "first size that fails), so the tuned result is the same whatever it says"),
    "autotuning.model_info.num_layers": (
        "as autotuning.model_info.hidden_size: reported model info, not used to choose experiments"),
    "zero_optimization.contiguous_gradients": (
        "gradients are always copied into flat, contiguous bucket buffers as autograd produces them (the "
        "parameter's .grad is freed at once), which is what true asks for; the values are the same either way"),
    "zero_optimization.round_robin_gradients": (
        "a DeepSpeed stage 1-2 offload speed-up that spreads gradient copies to the host over ranks; here each "
        "rank already receives only its own partition from the reduce-scatter and copies only that; the values "
        "are the same either way"),
    "zero_optimization.use_multi_rank_bucket_allreduce": (
        "with reduce_scatter: false zerospeed always reduces a bucket of all ranks' partitions with one "
        "all-reduce (what true asks for) instead of one reduce per owner; a sum is the same either way"),
    "zero_optimization.elastic_checkpoint": (
        "zerospeed checkpoints are always stored per parameter and load at any data-parallel size and stage "
        "(what DeepSpeed's elastic format was for); the saved and restored states are the same either way"),
    "elasticity.min_time": (
        "the minutes a resource scheduler should let an elastic job run before rescaling it: information for "
        "the scheduler, which neither DeepSpeed's engine nor zerospeed's reads; the run is the same either way"),
    "zero_optimization.memory_efficient_linear": (
        "under stage 3 a gathered weight's storage is freed after its module's forward even when autograd "
        "saved a view of it (e.g. W.t() in F.linear) and refilled for backward, for every op, not only "
        "linear: the memory effect of true; the computation is the same either way"),
    "zero_optimization.override_module_apply": (
        "DeepSpeed wraps nn.Module.apply inside zero.Init so that apply(fn) sees gathered parameters; zerospeed "
        "patches nothing: inside zero.Init every torch call that touches a cut parameter, in apply or anywhere "
        "else, runs on its full value and is written back (zero/stage3/init_writes.py), which is what true asks "
        "for; with false DeepSpeed would leave apply's writes on the empty placeholders, zerospeed still keeps them"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": (
        "DeepSpeed's choice to keep Muon's momentum in memory while other optimizer state is swapped to NVMe; "
        "zerospeed always keeps it in memory (Muon with NVMe optimizer offload is refused), what true asks for"),
    "optimizer.params.set_grad_none": (
        "DeepSpeed's FusedAdam option to set .grad to None in zero_grad(); zerospeed's parameters never keep a "
        ".grad (gradients move into the reducer's buffers, which are zeroed after each step), so the update is "
        "the same either way"),
    "zero_optimization.offload_optimizer.pipeline_read": (
        "the offloaded step always reads the next sub-groups' state from disk while it updates the current one "
        "(read-ahead bounded by buffer_count); DeepSpeed's false only turns that overlap off, with the same update"),
    "zero_optimization.offload_optimizer.pipeline_write": (
        "the offloaded step always writes updated state back while it updates the next sub-group (write-behind); "
        "DeepSpeed's false only turns that overlap off, with the same update"),
    "zero_optimization.offload_optimizer.fast_init": (
        "DeepSpeed's faster start-up of the nvme swap files; zerospeed always writes the fp32 master straight "
        "into the files and reserves Adam's zero state with posix_fallocate instead of writing it"),
    "aio.single_submit": (
        "a libaio submission detail (submit requests one by one vs in batches); zerospeed's I/O thread pool "
        "issues each request as soon as a queue slot frees; the bytes read and written are the same"),
    "aio.overlap_events": (
        "a libaio detail (overlap event completion with submission); zerospeed's thread pool always overlaps "
        "them (what true asks for); the bytes read and written are the same"),
    "pipeline.pipe_partitioned": (
        "partitions activations sent between pipeline stages across the tensor-parallel group; it has no effect "
        "without tensor parallelism (DeepSpeed ANDs it with model parallelism too), and a pipeline with a "
        "tensor-parallel axis is refused for now"),
    "pipeline.grad_partitioned": (
        "partitions activation gradients sent between stages across the tensor-parallel group; no effect without "
        "tensor parallelism (as in DeepSpeed), and a pipeline with a tensor-parallel axis is refused for now"),
    "bf16.immediate_grad_update": (
        "DeepSpeed's BF16_Optimizer adds each bf16 gradient into its fp32 buffer as soon as autograd produces it and "
        "frees it (true), or keeps every bf16 gradient until the end of backward (false: 2 more bytes per parameter "
        "at the peak); zerospeed's reducer always moves each gradient into its buffer as it arrives, what true "
        "asks for, and the sums are the same either way"),
    "pipeline.use_reentrant": (
        "selects torch's reentrant or non-reentrant recomputation for the pipeline's activation checkpoints; "
        "zerospeed always uses its own non-reentrant checkpoint (RNG replayed), whose gradients are the same"),
    "expert_parallel.disable_triton_grouped_mm": (
        "zerospeed has no Triton grouped-matmul kernel: experts run torch._grouped_mm or a per-expert loop "
        "(use_grouped_mm), the same numbers either way"),
    "expert_parallel.num_experts_attr": (
        "AutoEP reads the expert count from the experts' stacked weights ([E, ...]), which is what "
        "model.config's attribute states; the model is the same either way"),
    "expert_parallel.has_shared_experts": (
        "AutoEP keeps the HF MoE block's own forward, which runs its shared experts (dense parameters, "
        "trained data-parallel); the computation is the same either way"),
    "expert_parallel.shared_experts_pattern": ("as expert_parallel.has_shared_experts: the HF block runs its "
                                               "shared experts itself"),
    "expert_parallel.shared_experts_gate_pattern": ("as expert_parallel.has_shared_experts: the HF block applies "
                                                    "its shared-expert gate itself"),
    "compression_training.weight_quantization.shared_parameters.quantizer_kernel": (
        "DeepSpeed's choice of its CUDA quantizer kernel over its PyTorch code for weight quantization; both "
        "compute the same quantize-dequantize formula, which zerospeed computes with PyTorch on every device "
        "(compression/quantizers.py), so the quantized weights are the same either way"),
    "quantize_training.quantizer_kernel": (
        "as compression_training.weight_quantization.shared_parameters.quantizer_kernel: MoQ's quantizer runs "
        "as PyTorch code on every device, the same formula as DeepSpeed's kernel"),
    "hybrid_engine.tp_gather_partition_size": (
        "DeepSpeed reads it only for tensor-parallel generation (inference_tp_size > 1): how many layers to gather "
        "at a time before re-sharding them over the inference group; zerospeed gathers the weights once per phase "
        "to build the split copy (runtime/hybrid_tp.py); generation is the same either way"),
}

_log = logging.getLogger("zerospeed.config")


def present_hints(cfg: BaseModel) -> list[str]:
    """The ACCEPTED_HINTS keys that ``cfg`` (a parsed ZeroSpeedConfig) sets explicitly."""
    return [key for key, _ in _present(cfg)]


def _present(cfg: BaseModel) -> list[tuple[str, bool]]:
    """(key, changed): each hint key ``cfg`` sets, and whether its value differs from DeepSpeed's default."""
    found: list[tuple[str, bool]] = []
    for key in ACCEPTED_HINTS:
        *parents, leaf = key.split(".")
        node: Any = cfg
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
            if node is None:
                break
        if node is None:
            continue
        if isinstance(node, dict):
            if leaf in node:
                found.append((key, False))
        elif isinstance(node, BaseModel) and leaf in node.model_fields_set:
            found.append((key, getattr(node, leaf) != type(node).model_fields[leaf].default))
    return found


def log_accepted_hints(cfg: BaseModel) -> list[str]:
    """Log one line per hint key the config sets (call on rank 0, once at start-up); return those keys.

    A value changed from DeepSpeed's default is logged as a warning (someone expected an effect), a
    restated default as info."""
    found = _present(cfg)
    for key, changed in found:
        _log.log(logging.WARNING if changed else logging.INFO,
                 "config key '%s' is accepted as a hint with no separate effect: %s", key, ACCEPTED_HINTS[key])
    return [key for key, _ in found]
