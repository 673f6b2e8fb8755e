"""The process topology every parallelism shares: a named Cartesian grid of ranks, and its groups.

``ProcessTopology(axes, dims)`` numbers the grid row-major in the order of ``axes`` (the last axis varies
fastest), exactly as DeepSpeed does, so ``PipeDataParallelTopology(num_pp=2, num_dp=2)`` lays ranks out as::

    rank:  0        1        2        3
    coord: pipe=0   pipe=0   pipe=1   pipe=1
           data=0   data=1   data=0   data=1

Data-parallel peers are adjacent (fast links), pipeline neighbours are ``num_dp`` apart. The pure part
(coordinates, comm lists) needs no processes. ``PipelineParallelGrid`` creates the process groups once,
through ``zerospeed.comm``, and answers the ``mpu`` questions DeepSpeed and Megatron code ask.
"""

from __future__ import annotations

from collections import namedtuple
from itertools import product
from typing import Any

from .. import comm


def ProcessCoord(axes: list[str]) -> Any:  # noqa: N802 - DeepSpeed's name for the coordinate tuple type
    return namedtuple("ProcessCoord", axes)


class ProcessTopology:
    """Maps n-dimensional coordinates (named axes) to linear ranks, row-major in ``axes`` order."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: repeated axis name in {axes}")
        if any(d < 1 for d in dims):
            raise ValueError(f"ProcessTopology: every dim must be >= 1, got {dims}")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = ProcessCoord(axes)
        self.mapping: dict[Any, int] = {}
        for rank, coord in enumerate(product(*[range(d) for d in dims])):
            self.mapping[self.ProcessCoord(*coord)] = rank
        self._coords = list(self.mapping)  # rank -> coordinate

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at a full coordinate, e.g. ``get_rank(pipe=1, data=0)``."""
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(f"get_rank needs every axis {self.axes}, got {sorted(coord_kwargs)}")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"coordinate {coord_kwargs} is outside the topology {dict(zip(self.axes, self.dims))}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_rank_repr(self, rank: int, omit_axes: Any = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """``'model_01'``-style name of a rank's coordinate without ``omit_axes`` (used in file names)."""
        omit = frozenset(omit_axes)
        coord = self.get_coord(rank)
        return outer_sep.join(f"{ax}{inner_sep}{getattr(coord, ax):02d}" for ax in self.axes if ax not in omit)

    def get_dim(self, axis: str) -> int:
        """Processes along ``axis`` (0 when the topology has no such axis, as in DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        if not 0 <= rank < len(self._coords):
            raise ValueError(f"rank {rank} not found in topology (world size {len(self._coords)})")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """One rank list per group along ``axis``: ranks equal in every other axis (``[]`` for no such axis)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for other in product(*[range(self.get_dim(a)) for a in others]):
            fixed = dict(zip(others, other))
            lists.append([self.mapping[self.ProcessCoord(**fixed, **{axis: i})] for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Ranks whose coordinates match every given ``axis=value``."""
        return [r for c, r in self.mapping.items() if all(getattr(c, k) == v for k, v in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate along ``axis`` is ``idx``."""
        i = self.axes.index(axis)
        return [r for c, r in self.mapping.items() if c[i] == idx]

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism; data parallel peers adjacent (``axes=['pipe', 'data']``)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallelism; model peers adjacent (``axes=['pipe', 'data', 'model']``)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def _prime_factors(n: int) -> list[int]:
    """The prime factors of ``n`` in ascending order, with repeats (``12 -> [2, 2, 3]``, ``1 -> []``)."""
    if n < 1:
        raise ValueError(f"prime factors of a positive integer only, got {n}")
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


def default_topology(world_size: int) -> PipeDataParallelTopology:
    """DeepSpeed's default grid: alternate prime factors of the world between pipe and data."""
    pp = dp = 1
    for i, p in enumerate(_prime_factors(world_size)):
        if i % 2 == 0:
            pp *= p
        else:
            dp *= p
    return PipeDataParallelTopology(num_pp=pp, num_dp=dp)


class PipelineParallelGrid:
    """This rank's place in a topology and the process groups along each axis, built once.

    Implements the ``mpu`` interface: ``get_{data,model,pipe,slice}_parallel_{rank,world_size,group}`` and
    Megatron's ``get_tensor_model_parallel_*`` / ``get_pipeline_model_parallel_*``. As in DeepSpeed the
    "model parallel" group is every rank of one data-parallel replica (pipe x model), and the "slice" group
    is the tensor-parallel group. Every rank must construct the grid (group creation is collective).
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None) -> None:
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        self._topo = topology if topology is not None else default_topology(self.world_size)
        if self._topo.world_size() != self.world_size:
            raise ValueError(f"the topology {dict(zip(self._topo.axes, self._topo.dims))} holds "
                             f"{self._topo.world_size()} ranks but the job has {self.world_size}")
        self.data_parallel_size = max(self._topo.get_dim("data"), 1)
        self.pipe_parallel_size = max(self._topo.get_dim("pipe"), 1)
        self.model_parallel_size = max(self._topo.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        coord = self._topo.get_coord(self.global_rank)
        self.stage_id = getattr(coord, "pipe", 0)
        self.data_parallel_id = getattr(coord, "data", 0)
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.dp_groups = self._topo.get_axis_comm_lists("data") or [[r] for r in range(self.world_size)]
        self.pipe_groups = self._topo.get_axis_comm_lists("pipe") or [[r] for r in range(self.world_size)]
        self.model_groups = [sorted(self._topo.get_axis_list("data", d)) for d in range(self.data_parallel_size)] \
            if "data" in self._topo.axes else [list(range(self.world_size))]
        self.slice_groups = self._topo.get_axis_comm_lists("model") or [[r] for r in range(self.world_size)]
        self.dp_group, self.dp_proc_group = self._make(self.dp_groups)
        self.pp_group, self.pp_proc_group = self._make(self.pipe_groups)
        self.ds_model_group, self.ds_model_proc_group = self._make(self.model_groups)
        self.slice_group, self.slice_proc_group = self._make(self.slice_groups)
        self.ds_model_rank = self.ds_model_group.index(self.global_rank)
        self.ds_model_world_size = len(self.ds_model_group)
        self.p2p_groups = self._p2p_lists()

    def _make(self, lists: list[list[int]]) -> tuple[list[int], Any]:
        """Create one group per list (every rank creates all, in the same order); keep the one holding me."""
        mine: tuple[list[int], Any] = ([], None)
        for ranks in lists:
            group = comm.new_group(ranks) if comm.is_initialized() and self.world_size > 1 else None
            if self.global_rank in ranks:
                mine = (ranks, group)
        return mine

    def _p2p_lists(self) -> list[list[int]]:
        out = []
        for rank in range(self.world_size):
            for ranks in self.pipe_groups:
                if rank in ranks:
                    out.append([rank, ranks[(ranks.index(rank) + 1) % len(ranks)]])
                    break
        return out

    # --- coordinates -------------------------------------------------------------------------------
    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank holding ``stage_id`` with my other coordinates (overridable by ``kwargs``)."""
        me = self._topo.get_coord(self.global_rank)
        return self._topo.get_rank(**me._replace(pipe=stage_id, **kwargs)._asdict())

    # --- mpu: pipeline -----------------------------------------------------------------------------
    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_proc_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group

    # --- mpu: data ---------------------------------------------------------------------------------
    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    # --- mpu: model (one whole replica: pipe x tensor) ---------------------------------------------
    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        return self.ds_model_proc_group

    # --- mpu: tensor ("slice") ---------------------------------------------------------------------
    def get_slice_parallel_rank(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "model", 0)

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group

    def device_mesh(self, device_type: str = "cpu") -> Any:
        """The same grid as a ``torch.distributed.device_mesh.DeviceMesh`` (for DTensor-based parallelisms)."""
        return comm.device_mesh(device_type, self._topo.dims, self._topo.axes)
