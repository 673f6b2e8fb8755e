"""The only importer of torch.distributed: process groups, collectives, accounting.

Every other package reaches communication through these functions, with the process group
passed explicitly, so communication is counted in one place and fails with a precise message.
"""

from . import symmetric
from .along_dim import PendingTensor, all_gather_along_dim, reduce_scatter_along_dim
from .backend import (
    DEFAULT_TIMEOUT,
    Group,
    backend_name,
    default_store,
    barrier,
    destroy,
    device_for_backend,
    file_store,
    get_local_rank,
    get_local_world_size,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    new_group,
    set_timeout,
    world_group,
)
from .collectives import (
    CollectiveError,
    Handle,
    ReduceOp,
    all_gather,
    all_gather_by_broadcast,
    all_gather_in_place,
    gathers_in_place,
    all_gather_object,
    all_reduce,
    all_reduce_flags,
    all_reduce_max_flag,
    all_to_all_single,
    broadcast,
    broadcast_object,
    exchange_ints,
    reduce_scatter,
)
from .compressed import all_to_all, compressed_all_reduce, error_buffers, pack_signs, padded_numel, unpack_signs
from .hierarchy import Hierarchy, hierarchical_all_gather, intra_node_group, ranks_per_node_from_env
from .logger import COMMS_LOGGER, CommsLogger, OpStats, recording
from .quantized_grads import dequantize_int4, quantize_int4, quantized_reduce_scatter
from .quantized import (QuantizedGather, dequantize_fp8, dequantize_int8, quant_groups, quantize_fp8, quantize_int8,
                        quantized_all_gather)
from .sparse import row_sparse_all_reduce, sparse_all_reduce, topk_count, union_sparse_all_reduce
from .p2p import P2P, P2PHandle, device_mesh, exchange, global_rank_of
from .recoverable import RecoverableGroup, resolve
from .packed import all_gather_packed
from .deepspeed_names import (all_gather_into_tensor, configure, destroy_process_group, get_global_rank,
                              get_world_group, inference_all_reduce, log_summary, monitored_barrier,
                              reduce_scatter_tensor)

__all__ = [
    "COMMS_LOGGER", "DEFAULT_TIMEOUT", "recording", "CollectiveError", "CommsLogger", "Group", "Handle", "OpStats",
    "P2P", "P2PHandle", "device_mesh", "exchange", "global_rank_of",
    "RecoverableGroup", "ReduceOp", "all_gather", "all_gather_by_broadcast", "all_gather_in_place", "all_gather_packed", "gathers_in_place", "all_gather_object", "all_reduce", "all_reduce_flags", "all_reduce_max_flag", "all_to_all_single", "backend_name", "default_store",
    "barrier", "broadcast", "broadcast_object", "destroy", "device_for_backend", "exchange_ints", "file_store", "get_local_rank",
    "get_local_world_size", "get_rank",
    "get_world_size", "init_distributed", "is_initialized", "new_group", "reduce_scatter", "resolve", "set_timeout", "world_group",
    "all_to_all", "compressed_all_reduce", "error_buffers", "pack_signs", "padded_numel", "unpack_signs",
    "row_sparse_all_reduce", "sparse_all_reduce", "topk_count", "union_sparse_all_reduce",
    "PendingTensor", "all_gather_along_dim", "reduce_scatter_along_dim",
    "Hierarchy", "hierarchical_all_gather", "intra_node_group", "ranks_per_node_from_env", "dequantize_int4", "quantize_int4", "quantized_reduce_scatter",
    "QuantizedGather", "dequantize_fp8", "dequantize_int8", "quant_groups", "quantize_fp8", "quantize_int8",
    "quantized_all_gather",
    "all_gather_into_tensor", "inference_all_reduce", "configure", "destroy_process_group", "get_global_rank", "get_world_group",
    "log_summary", "monitored_barrier", "reduce_scatter_tensor",
]
