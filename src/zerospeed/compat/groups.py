"""``deepspeed.utils.groups``: DeepSpeed's process-group helpers over zerospeed's topology
(``parallel/topology.py``) and expert groups (``parallel/expert/groups.py``).

DeepSpeed keeps its groups in module globals made by ``_create_expert_and_data_parallel`` /
``_create_model_parallel``. zerospeed's engine owns its groups and never reads these: the expert groups
made here live in one process default (``_PROCESS``), written only when user code calls DeepSpeed's
module-level ``_create_expert_and_data_parallel`` and read only by the DeepSpeed-named helpers that look
them up without a group argument (``deepspeed.runtime.utils.CheckOverflow``). They belong to the process
group they were made in: a new default group (destroy, then init again) starts with none.
``_create_model_parallel`` still raises (pass an ``mpu`` to ``initialize()``). Without a model- or
pipeline-parallel grid, the data-parallel group is the whole world, as in DeepSpeed before any mpu is set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import comm
from ..config import NotSupportedYetError
from ..parallel.expert.groups import ExpertGroups, create_expert_groups, expert_rank_lists, group_name
from ..parallel.topology import ProcessTopology


class GroupsNotCreatedError(ValueError, AssertionError):
    """An expert group asked for before ``_create_expert_and_data_parallel`` made it (DeepSpeed asserts)."""


@dataclass
class _ProcessGroups:
    """The expert groups DeepSpeed's module-level API made, and the default group they were made under."""

    expert: dict[str, ExpertGroups] = field(default_factory=dict)
    world: Any = None

    def current(self) -> dict[str, ExpertGroups]:
        world = comm.world_group() if comm.is_initialized() else None
        if world is not self.world:  # made under another process group: stale
            self.expert.clear()
            self.world = world
        return self.expert


_PROCESS = _ProcessGroups()


def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1,
                               use_data_before_expert_parallel_: bool = False) -> tuple[list[list[int]],
                                                                                        list[list[int]]]:
    """(expert-parallel, expert-data-parallel) rank lists of a pipe x data x tensor grid, DeepSpeed's layout."""
    dp = world_size // (tensor_parallel_size_ * pipeline_parallel_size_)
    topo = ProcessTopology(axes=["pipe", "data", "model"], dims=[pipeline_parallel_size_, dp, tensor_parallel_size_])
    return expert_rank_lists(topo.get_axis_comm_lists("data"), expert_parallel_size_,
                             use_data_before_expert_parallel_)


def _create_expert_and_data_parallel(expert_parallel_size_: int, mp_size: int | None = None,
                                     pp_size: int | None = None, mp_mode: str = "tp",
                                     use_data_before_expert_parallel_: bool = False,
                                     folding_spec: Any = None) -> None:
    """Make the expert-parallel and expert-data-parallel groups of ``expert_parallel_size_`` (collective),
    laid out as DeepSpeed lays them (``parallel/expert/groups.py``), inside each of ``pp_size`` pipeline
    stages of consecutive ranks; a size made before is kept."""
    if not comm.is_initialized():
        raise RuntimeError("deepspeed.utils.groups._create_expert_and_data_parallel needs an initialized "
                           "process group (deepspeed.init_distributed())")
    if (mp_size or 1) > 1 or folding_spec is not None:
        raise NotSupportedYetError("deepspeed.utils.groups._create_expert_and_data_parallel(mp_size=...)",
                                   "expert groups folded with tensor or sequence parallelism through the module-"
                                   "level API; pass an mpu to initialize() and the MoE layers' ep_size")
    registry = _PROCESS.current()
    world, stages = comm.get_world_size(), pp_size or 1
    if world % stages:
        raise ValueError(f"pp_size {stages} must divide the world size {world}")
    stride = world // stages
    if stages == 1:
        create_expert_groups(expert_parallel_size_, use_data_before_expert_parallel_, registry)
        return
    if group_name(expert_parallel_size_) in registry:
        return
    ep_lists, edp_lists = expert_rank_lists([list(range(s, s + stride)) for s in range(0, world, stride)],
                                            expert_parallel_size_, use_data_before_expert_parallel_)
    me, made = comm.get_rank(), {}
    for kind, lists in (("ep", ep_lists), ("edp", edp_lists)):
        for ranks in lists:
            group = comm.new_group(ranks)  # collective: every rank creates every group
            if me in ranks:
                made[kind] = (ranks, group)
    registry[group_name(expert_parallel_size_)] = ExpertGroups(
        group_name(expert_parallel_size_), expert_parallel_size_, made["ep"][0], made["edp"][0], made["ep"][1],
        made["edp"][1])


def _groups(name: str) -> ExpertGroups:
    groups = _PROCESS.current().get(name)
    if groups is None:
        raise GroupsNotCreatedError(f"expert parallel group {name!r} is not initialized: call "
                                    "deepspeed.utils.groups._create_expert_and_data_parallel(ep_size) first")
    return groups


def _get_max_expert_size() -> int | None:
    """The largest ``ep_size`` created (None: none yet)."""
    sizes = [g.ep_size for g in _PROCESS.current().values()]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> Any:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_parallel_group(group_name: str) -> Any:
    return _groups(group_name).ep_group


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return _groups(group_name).ep_ranks


def _get_expert_data_parallel_group(group_name: str) -> Any:
    return _groups(group_name).edp_group


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return _groups(group_name).edp_ranks


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return {name: g.ep_group for name, g in _PROCESS.current().items()}


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return {name: g.edp_group for name, g in _PROCESS.current().items()}


def _get_expert_parallel_world_size(group_name: str) -> int:
    return len(_groups(group_name).ep_ranks)


def _get_expert_parallel_rank(group_name: str) -> int:
    return _groups(group_name).ep_rank


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _groups(group_name).edp_size


def _get_expert_data_parallel_rank(group_name: str) -> int:
    groups = _groups(group_name)
    return groups.edp_ranks.index(comm.get_rank())


def _get_data_parallel_group() -> Any:
    """The data-parallel group: the world (zerospeed's collectives read ``None`` as the world group)."""
    return comm.get_world_group()


def _get_data_parallel_world_size() -> int:
    return comm.get_world_size() if comm.is_initialized() else 1


def _get_data_parallel_rank() -> int:
    return comm.get_rank() if comm.is_initialized() else 0


def _get_model_parallel_world_size() -> int:
    return 1


def _get_model_parallel_rank() -> int:
    return 0


def _create_model_parallel(*args: Any, **kwargs: Any) -> None:
    """DeepSpeed's global model-parallel groups: refused (see the module docstring)."""
    raise NotSupportedYetError(
        "deepspeed.utils.groups._create_model_parallel", "zerospeed keeps no module-level model-parallel "
        "groups; pass an mpu to initialize()")


__all__ = ["GroupsNotCreatedError", "_create_expert_and_data_parallel", "_create_model_parallel",
           "_get_data_parallel_group", "_get_data_parallel_rank", "_get_data_parallel_world_size",
           "_get_expert_data_parallel_group", "_get_expert_data_parallel_group_dict",
           "_get_expert_data_parallel_group_ranks", "_get_expert_data_parallel_rank",
           "_get_expert_data_parallel_world_size", "_get_expert_parallel_group", "_get_expert_parallel_group_dict",
           "_get_expert_parallel_group_ranks", "_get_expert_parallel_rank", "_get_expert_parallel_ranks",
           "_get_expert_parallel_world_size", "_get_max_expert_parallel_group", "_get_max_expert_size",
           "_get_max_expert_size_name", "_get_model_parallel_rank", "_get_model_parallel_world_size"]
