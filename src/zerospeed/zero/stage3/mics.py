"""MiCS (``mics_shard_size``): ZeRO-3 sharded within groups of a few ranks, replicated across the groups.

With ``N`` data-parallel ranks and shard size ``m`` (``m`` divides ``N``) the ranks form ``N/m`` *shard groups*
of ``m`` consecutive ranks (``{0..m-1}``, ``{m..2m-1}``, ...) and ``m`` *replica groups* (the ranks with the
same place in every shard group: ``{i, m+i, 2m+i, ...}``)::

    N = 4, m = 2:   shard groups {0,1} {2,3}     replica groups {0,2} {1,3}

Parameters, gradients and optimizer state are partitioned over the shard group exactly as ZeRO-3 partitions
them over all ranks (so gathers stay inside the group: a node, say); every shard group holds the same model
state. Gradients are reduce-scattered inside the shard group on each micro-step, then, once per
accumulation boundary, the reduced partition is all-reduced over the replica group (DeepSpeed's
``allreduce_mics_shard_grads``). The loss scaling divides by ``N`` as everywhere, so the sum over both
levels is the data-parallel mean. The gradient norm counts each shard once: on the first replica.

``mics_hierarchical_params_gather``: when a shard group spans several nodes (``m`` larger than the ranks per
node), its gathers run in two levels, across the nodes of the group first, then inside each node (the
values are the same; DeepSpeed refuses the key when the group fits in one node, and so do we).
"""

from __future__ import annotations

from dataclasses import dataclass

from ... import comm
from ...config.errors import ConfigError, NotSupportedYetError

KEY = "zero_optimization.mics_shard_size"
HIER_KEY = "zero_optimization.mics_hierarchical_params_gather"


@dataclass(frozen=True)
class MicsGroups:
    """This rank's shard group, its replica group (None with a single shard group), the optional two-level
    gather inside the shard group."""

    shard: comm.Group
    replicas: comm.Group | None
    size: int
    hierarchy: comm.Hierarchy | None = None


def mics_groups(shard_size: int, hierarchical: bool, dp_group: comm.Group | None, offloaded: bool) -> MicsGroups | None:
    """The MiCS groups for ``mics_shard_size`` (None when MiCS is off: ``-1``, DeepSpeed's default)."""
    if shard_size < 0:
        if hierarchical:
            raise ConfigError(HIER_KEY, "mics_hierarchical_params_gather needs mics_shard_size >= 1")
        return None
    world = comm.get_world_size(dp_group)
    if shard_size == 0 or world % shard_size:
        raise ConfigError(KEY, f"mics_shard_size {shard_size} must be >= 1 and divide the data-parallel world size "
                               f"{world} (or -1: off)")
    if world != comm.get_world_size():
        raise NotSupportedYetError(KEY, "MiCS with model, pipeline or expert parallel groups (a data-parallel group "
                                        "smaller than the world) is not supported yet by zerospeed")
    if offloaded:
        raise NotSupportedYetError(KEY, "MiCS with parameter or optimizer offload is not supported yet by zerospeed")
    hierarchy = _hierarchy(shard_size) if hierarchical else None
    if shard_size == world:  # one shard group: plain ZeRO-3's partitioning (only the gathers may be two-level)
        return MicsGroups(dp_group, None, shard_size, hierarchy)
    levels = comm.Hierarchy(shard_size)  # intra: the shard groups (consecutive blocks); inter: the replica groups
    return MicsGroups(levels.intra, levels.inter, shard_size, hierarchy)


def _hierarchy(shard_size: int) -> comm.Hierarchy:
    per_node = comm.ranks_per_node_from_env()
    if per_node >= shard_size or shard_size % per_node:
        raise ConfigError(HIER_KEY, f"mics_hierarchical_params_gather needs a shard group spanning several nodes: "
                                    f"mics_shard_size {shard_size} must be a multiple (> 1) of the ranks per node "
                                    f"{per_node} (LOCAL_WORLD_SIZE), as in DeepSpeed")
    return comm.Hierarchy(per_node, block=shard_size)


__all__ = ["MicsGroups", "mics_groups"]
