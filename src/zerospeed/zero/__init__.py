"""ZeRO: partition plan (pure), sharded parameter groups, bucketed gradient reduction, the optimizer."""

from .grad_reducer import GradReducer, ReduceSettings
from .optimizer import ZeroOptimizer
from .partition import BucketPlan, ParamSlot, PartitionPlan, plan_partitions, shard_size
from .sharded_group import ShardedGroup

__all__ = ["BucketPlan", "GradReducer", "ParamSlot", "PartitionPlan", "ReduceSettings", "ShardedGroup",
           "ZeroOptimizer", "plan_partitions", "shard_size"]
