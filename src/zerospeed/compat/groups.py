"""``deepspeed.utils.groups``: DeepSpeed's process-group helpers that hold no state, over zerospeed's topology
(``parallel/topology.py``) and expert groups (``parallel/expert/groups.py``).

DeepSpeed keeps its groups in module globals made by ``_create_model_parallel`` /
``_create_expert_and_data_parallel``; zerospeed keeps no module-level runtime state (the engine owns its
groups), so those two raise ``NotSupportedYetError`` naming the engine's way instead. Without a model- or
pipeline-parallel grid, the data-parallel group is the whole world, as in DeepSpeed before any mpu is set.
"""

from __future__ import annotations

from typing import Any

from .. import comm
from ..config import NotSupportedYetError
from ..parallel.expert.groups import expert_rank_lists
from ..parallel.topology import ProcessTopology


def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1,
                               use_data_before_expert_parallel_: bool = False) -> tuple[list[list[int]],
                                                                                        list[list[int]]]:
    """(expert-parallel, expert-data-parallel) rank lists of a pipe x data x tensor grid, DeepSpeed's layout."""
    dp = world_size // (tensor_parallel_size_ * pipeline_parallel_size_)
    topo = ProcessTopology(axes=["pipe", "data", "model"], dims=[pipeline_parallel_size_, dp, tensor_parallel_size_])
    return expert_rank_lists(topo.get_axis_comm_lists("data"), expert_parallel_size_,
                             use_data_before_expert_parallel_)


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


def _refuse(name: str) -> NotSupportedYetError:
    return NotSupportedYetError(
        f"deepspeed.utils.groups.{name}", "zerospeed keeps no module-level process groups; pass the MoE "
        "layers' ep_size (the engine creates the expert groups) or an mpu to initialize()")


def _create_expert_and_data_parallel(*args: Any, **kwargs: Any) -> None:
    """DeepSpeed's global expert groups: refused (see the module docstring)."""
    raise _refuse("_create_expert_and_data_parallel")


def _create_model_parallel(*args: Any, **kwargs: Any) -> None:
    """DeepSpeed's global model-parallel groups: refused (see the module docstring)."""
    raise _refuse("_create_model_parallel")


__all__ = ["_create_expert_and_data_parallel", "_create_model_parallel", "_get_data_parallel_group",
           "_get_data_parallel_rank", "_get_data_parallel_world_size", "_get_expert_parallel_ranks",
           "_get_model_parallel_rank", "_get_model_parallel_world_size"]
