"""DeepSpeed's memory estimators for ZeRO-2 and ZeRO-3 model states, with its formulas, arguments and
printed table (``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_*`` and ``...stage3.estimate_zero3_*``).

They count model states only (16-bit parameters and gradients, fp32 master and Adam's two moments, per
GPU and per CPU, times ``additional_buffer_factor`` on the host), for a mixed-precision Adam run.
Activations, communication buffers and the framework's own memory are not in them.
"""

from __future__ import annotations

from torch import nn

_GB = 2**30


# --- ZeRO-2 -----------------------------------------------------------------------------------------
def estimate_zero2_model_states_mem_needs(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True, additional_buffer_factor: float = 1.5
                                          ) -> tuple[int, int]:
    """``(cpu_bytes, gpu_bytes)`` per process: 16-bit parameters on the GPU, and with ``cpu_offload`` the rest
    (gradients 2+4, master 4, moments 8 bytes/param) on the host; else 18 bytes/param split over every GPU."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def _total_params(model: nn.Module) -> int:
    """Parameters counted once even when shared (tied embeddings)."""
    return sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())


def _header(total_params: int, num_gpus_per_node: int, num_nodes: int, largest: int | None = None) -> None:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    sw = f"SW: Model with {int(total_params / 1e6)}M total params"
    sw += "." if largest is None else f", {int(largest / 1e6)}M largest layer params."
    print("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n{sw}")
    print("  per CPU  |  per GPU |   Options")


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-2 table for a hypothetical model of ``total_params`` parameters."""
    _header(total_params, num_gpus_per_node, num_nodes)
    for cpu_offload in (True, False):
        cpu_mem, gpu_mem = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes,
                                                                 cpu_offload, additional_buffer_factor)
        print(f" {cpu_mem / _GB:7.2f}GB | {gpu_mem / _GB:6.2f}GB | offload_optimizer={'cpu ' if cpu_offload else 'none'}")


def estimate_zero2_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-2 table for ``model``."""
    estimate_zero2_model_states_mem_needs_all_cold(_total_params(model), num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


# --- ZeRO-3 -----------------------------------------------------------------------------------------
def estimate_zero3_model_states_mem_needs(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                                          num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                                          zero_init: bool = True, additional_buffer_factor: float = 1.5
                                          ) -> tuple[int, int, int]:
    """``(cpu_bytes, gpu_bytes, largest_layer_bytes)`` per process. The GPU always holds the largest layer
    gathered (4 bytes/param, DeepSpeed's allowance); the rest follows where parameters and optimizer live."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            per_param = 18 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 18 * gpus_factor)
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            per_param = 16 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 16 * gpus_factor)
        cpu_mem = total_params * per_param * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        held = largest_layer_params if zero_init else total_params
        cpu_mem = held * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def _largest_layer(model: nn.Module) -> int:
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-3 table (offload and ``zero.Init`` combinations) for a hypothetical model."""
    _header(total_params, num_gpus_per_node, num_nodes, largest_layer_params)
    for cpu_offload in (True, False):
        for cpu_offload_params in (True, False):
            if not cpu_offload and cpu_offload_params:
                continue
            for zero_init in (True, False):
                cpu_mem, gpu_mem, _ = estimate_zero3_model_states_mem_needs(
                    total_params, largest_layer_params, num_gpus_per_node, num_nodes, cpu_offload,
                    cpu_offload_params, zero_init, additional_buffer_factor)
                options = (f"offload_param={'cpu ' if cpu_offload_params else 'none'}, "
                           f"offload_optimizer={'cpu ' if cpu_offload else 'none'}, zero_init={int(zero_init)}")
                print(f" {cpu_mem / _GB:7.2f}GB | {gpu_mem / _GB:6.2f}GB | {options}")


def estimate_zero3_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-3 table for ``model``."""
    estimate_zero3_model_states_mem_needs_all_cold(_total_params(model), _largest_layer(model), num_gpus_per_node,
                                                   num_nodes, additional_buffer_factor)


__all__ = [
    "estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs_all_live",
]
