"""Tensor parallelism (Megatron-style): layers that hold a slice of each matrix, over an explicit group.

``shard`` (DeepSpeed's shard-size rules), ``partition`` (which slice a rank holds), ``mappings`` (autograd
collectives in and out of the parallel region, sequence parallelism included), ``column`` / ``row``
(``LinearLayer`` / ``LinearAllreduce``), ``overlap`` (async input-gradient collective), ``fused`` (fused QKV /
gate-up split per sub-matrix), ``embedding`` and ``cross_entropy`` (vocab-parallel), ``sequence`` (Megatron
sequence parallelism: what the layers' ``sequence_parallel=True`` does not cover).
"""

from .column import LinearLayer, VocabParallelLinear, conv_LinearLayer
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .fused import (FusedQKVLinear, GateUpPack_LinearLayer, SubParamLinearAllreduce, SubParamLinearLayer,
                    fused_LinearLayer, qkv_sizes)
from .layer import TensorParallel_Layer, TensorParallelLayer, is_conv1d, tp_shard_specs
from .mappings import (copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                       gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                       scatter_to_tensor_model_parallel_region, tp_rank, tp_world_size)
from .overlap import ColumnParallelMatmul
from .partition import TPShardSpec, even_spec, regroup_gathered, shard, unshard
from .row import Conv_LinearALlreduce, LinearAllreduce, LinearAllreduceWithReplicatedInput
from .sequence import SequenceParallelGradSync
from .shard import AutoTPMeta, ShardSizeError, checked_shard_sizes, get_shard_size, get_shard_size_list, split_heads

__all__ = [
    "Conv_LinearALlreduce", "TensorParallel_Layer", "conv_LinearLayer", "fused_LinearLayer", "is_conv1d",
    "FusedQKVLinear", "GateUpPack_LinearLayer", "SequenceParallelGradSync", "SubParamLinearAllreduce",
    "SubParamLinearLayer", "VocabParallelEmbedding", "qkv_sizes", "regroup_gathered", "vocab_parallel_cross_entropy",
    "AutoTPMeta", "ColumnParallelMatmul", "LinearAllreduce", "LinearAllreduceWithReplicatedInput", "LinearLayer",
    "ShardSizeError", "TPShardSpec", "TensorParallelLayer", "VocabParallelLinear", "checked_shard_sizes",
    "copy_to_tensor_model_parallel_region", "even_spec", "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region", "get_shard_size", "get_shard_size_list",
    "reduce_from_tensor_model_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "scatter_to_tensor_model_parallel_region", "shard", "split_heads",
    "tp_rank", "tp_shard_specs", "tp_world_size", "unshard",
]
