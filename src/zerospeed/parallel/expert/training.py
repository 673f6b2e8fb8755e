"""Training a model with MoE layers under the ZeRO engine: which group reduces which gradient.

Dense parameters are replicated on every data-parallel rank; an expert's parameters only on the ranks
of its expert-data-parallel (``edp``) group. So, as in DeepSpeed:

* dense gradients are averaged over the data-parallel world, as without MoE;
* expert gradients are summed over their ``edp`` group and divided by the *data-parallel world size*
  (the all-to-all backward already summed the contributions of the ``ep`` ranks' tokens), which keeps
  them independent of ``ep_size``: ``ep=2`` trains exactly like ``ep=1``;
* ZeRO-1/2 partition expert state over the ``edp`` group and dense state over the data-parallel group,
  in separate sharded groups (optimizer param groups with ``moe: True`` and the expert group ``name``);
  ZeRO-3 also cuts the expert parameters themselves over their ``edp`` group (``partition_groups``);
* the global gradient norm (clipping) is the true norm: dense squares summed over the dense shards,
  expert squares over the ``edp`` shards and then over the ``ep`` ranks (which hold different experts),
  parameters split over a tensor group (expert tensor parallelism) over that group, and, inside a
  pipeline, everything over the stages: ``norm_axes_parts`` describes it to ``zero/norm_axes.py``;
* at start, dense parameters come from data-parallel rank 0, expert parameters from ``edp`` rank 0.

With a pipeline or a tensor-parallel ``mpu`` (``grid``) the expert groups are cut inside the grid's
data-parallel groups (``groups.expert_rank_lists``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ... import comm
from ...config.errors import NotSupportedYetError
from ...zero import ShardedGroup
from ...zero.reducer_parts import ShardAxis
from .auto.folding import TensorFold
from .groups import ExpertGroups
from .layer import MoE
from .tensor_parallel import is_tensor_parallel_param
from .utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer


def moe_layers(model: nn.Module) -> list[Any]:
    """DeepSpeed MoE layers and AutoEP experts (``auto/layer.py``): both serve ``set_deepspeed_parallelism``,
    ``ep_size``, ``expert_groups``, ``expert_parameters()`` and ``expert_tp``."""
    from .auto.layer import AutoEPExperts

    return [m for m in model.modules() if isinstance(m, (MoE, AutoEPExperts))]


class MoETraining:
    """The expert groups of one engine (a registry it owns) and the helpers ``runtime/build.py`` calls."""

    def __init__(self, model: nn.Module, dp_group: Any, stage: int, offload_device: str = "none",
                 data_before_expert: bool = False, grid: Any = None, fold_group: Any = None) -> None:
        """``grid``: the pipeline's (or a user's mpu) grid; expert groups are cut inside its data-parallel groups.
        ``fold_group``: AutoTP's tensor group, which AutoEP layers fold over (``auto/folding.py``); their expert
        groups are then cut over the whole world (DeepSpeed's folding layout: ``ep`` consecutive ranks)."""
        if fold_group is not None:
            grid = None
        elif grid is None and comm.is_initialized() and comm.get_world_size(dp_group) != comm.get_world_size():
            raise ValueError("MoE layers with a data-parallel group smaller than the world need the grid that "
                             "defines it (initialize(mpu=...) or a PipelineModule)")
        self.registry: dict[str, ExpertGroups] = {}
        for layer in moe_layers(model):
            layer.set_deepspeed_parallelism(data_before_expert, self.registry, grid)
        fold = 1 if fold_group is None else comm.get_world_size(fold_group)
        if fold_group is not None:
            for layer in moe_layers(model):
                layer.fold_tensor_parallel(TensorFold(fold_group, fold, comm.get_rank(fold_group)))
        self.dp_group = dp_group
        self.stage = stage
        self.tp = next((m.expert_tp for m in moe_layers(model)), None)  # expert tensor parallelism
        if self.tp is not None and offload_device == "nvme":  # per-group squares only: no split by tensor slice
            raise NotSupportedYetError("zero_optimization.offload_optimizer.device", "expert tensor parallelism "
                                       "with NVMe optimizer offload is not supported yet by zerospeed; use cpu")
        self.hooks = []
        for layer in moe_layers(model):
            divisor = layer.ep_size / fold  # the all-to-all backward summed ep ranks' routes (folded: tp shares)
            if divisor != 1:
                for p in layer.expert_parameters():
                    if p.requires_grad:  # frozen experts take no gradient
                        self.hooks.append(p.register_hook(lambda g, d=divisor: g / d))

    # --- parameter groups ---------------------------------------------------------------------------------
    def split_groups(self, raw_groups: list[dict[str, Any]], from_client: bool) -> list[dict[str, Any]]:
        """Give expert params groups of their own (DeepSpeed does this for ``model_parameters``)."""
        mixed = [i for i, g in enumerate(raw_groups) if self._kind(g["params"]) == "mixed"]
        if not mixed:
            return raw_groups
        if from_client:
            raise ValueError(f"the optimizer's param group(s) {mixed} mix expert and dense parameters: build the "
                             "optimizer over zerospeed.moe.utils.split_params_into_different_moe_groups_for_optimizer"
                             "(param_groups) (each group needs a 'name'), as in DeepSpeed")
        named = [{**g, "name": g.get("name", f"dense-params-{i}" if i else "dense-params")}
                 for i, g in enumerate(raw_groups)]
        return [g for g in split_params_into_different_moe_groups_for_optimizer(named) if g["params"]]

    @staticmethod
    def _kind(params: list[nn.Parameter]) -> str:
        flags = {is_moe_param(p) for p in params}
        return "mixed" if len(flags) == 2 else ("expert" if flags == {True} else "dense")

    def expert_groups_of(self, params: list[nn.Parameter]) -> ExpertGroups | None:
        """The expert groups of a param group made of expert params (None for dense)."""
        kind = self._kind(params)
        if kind == "dense":
            return None
        names = {p.group_name for p in params}
        if kind == "mixed" or len(names) != 1:
            raise ValueError("a parameter group mixes expert and dense parameters (or several expert groups); "
                             "split it with split_params_into_different_moe_groups_for_optimizer")
        return self.registry[names.pop()]

    def partition_groups(self, model: nn.Module) -> dict[int, Any]:
        """ZeRO-3: ``id(param) -> group`` to partition each expert parameter over (its ``edp`` group)."""
        return {id(p): layer.expert_groups.edp_group for layer in moe_layers(model)
                for p in layer.expert_parameters()}

    def sharded_group(self, params: list[nn.Parameter], options: dict[str, Any], stage: int, bucket: int,
                      compute: torch.dtype, stage3: Any = None, **kwargs: Any) -> ShardedGroup:
        """An expert param group, partitioned over its ``edp`` group (stages 1-3)."""
        eg = self.expert_groups_of(params)
        assert eg is not None
        rank = eg.edp_ranks.index(comm.get_rank()) if comm.is_initialized() else 0
        if stage3 is not None:
            grp = stage3.make_group(params, options, rank, bucket, group=eg.edp_group, **kwargs)
        else:
            grp = ShardedGroup(params, options, 1 if stage == 0 else eg.edp_size, rank, bucket, compute, **kwargs)
        grp.replica_rank = rank  # checkpoints: edp rank 0 writes unpartitioned experts
        return grp

    @torch.no_grad()
    def sync_experts(self, model: nn.Module) -> None:
        """Every ``edp`` group starts from the expert values of its first rank (ZeRO-3 did it while cutting)."""
        if self.stage == 3:
            return
        for layer in moe_layers(model):
            eg = layer.expert_groups
            assert eg is not None
            if eg.edp_size > 1:
                for p in layer.expert_parameters():
                    comm.broadcast(p.data, src=eg.edp_ranks[0], group=eg.edp_group)

    # --- reduction and the step -------------------------------------------------------------------------
    def shard_axes(self, live: list[ShardedGroup]) -> list[ShardAxis | None]:
        """Each optimizer group's own partition axis: an expert set's edp group (None: dense, data-parallel)."""
        sets = [self.expert_groups_of(g.params) for g in live]
        return [None if eg is None else ShardAxis(eg.name, eg.edp_group, eg.edp_size) for eg in sets]

    def norm_axes_parts(self, live: list[ShardedGroup]) -> tuple[list[Any], frozenset[int], Any]:
        """What experts add to the grad norm (``zero/norm_axes.py``): each optimizer group's partition group
        (an expert set's edp group, None for dense), the params split over the expert tensor group, that group."""
        axes = self.shard_axes(live)
        split = frozenset(id(p) for g in live for p in g.params if self.tp is not None and is_tensor_parallel_param(p))
        return [None if a is None else a.group for a in axes], split, None if self.tp is None else self.tp.group
