"""ZeRO: partition plan (pure), sharded parameter groups, bucketed gradient reduction, the optimizer,
and stage 3 (partitioned parameters, ``Init``, ``GatheredParameters``)."""

from .grad_reducer import GradReducer, ReducerWiring, ReduceSettings, ShardAxis
from .optimizer import ZeroOptimizer
from .partition import BucketPlan, ParamSlot, PartitionPlan, plan_partitions, shard_size
from .sharded_group import ShardedGroup
from .stage3 import (
    GatheredParameters,
    Init,
    MiCS_Init,
    RanksDivergedError,
    ShardState,
    any_rank_running,
    full_state_dict,
    register_external_parameter,
    save_16bit_model,
    shard_of,
    synced_generate,
    unwrap_model_for_generation,
)

__all__ = ["BucketPlan", "GatheredParameters", "GradReducer", "Init", "MiCS_Init", "ParamSlot", "PartitionPlan",
           "RanksDivergedError", "ReduceSettings", "ShardState", "ShardedGroup", "ZeroOptimizer", "any_rank_running",
           "full_state_dict", "plan_partitions", "register_external_parameter", "save_16bit_model", "shard_of",
           "shard_size", "synced_generate", "unwrap_model_for_generation"]
