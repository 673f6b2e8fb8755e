"""The (data, sequence) grid of sequence parallelism and its process groups, as DeepSpeed lays them out.

``sequence_parallel_size`` P splits a world of W ranks into W/P sequence groups of adjacent ranks (they
hold one sample's sequence between them) and P data-parallel groups of ranks P apart (they hold different
samples). World 4, P 2::

    rank:      0   1   2   3
    data:      0   0   1   1      sequence groups {0,1} {2,3}   (all-to-all attention)
    sequence:  0   1   0   1      data groups     {0,2} {1,3}   (different samples)

ZeRO partitions and reduces over the sequence-data-parallel group, every rank of the grid (DeepSpeed's
``seq_data_parallel_group``). ``SequenceParallelGrid`` answers the ``mpu`` questions of DeepSpeed's
``parallel_state_sp`` (``get_sequence_parallel_group``, ``get_sequence_data_parallel_group``, ...).
"""

from __future__ import annotations

from typing import Any

from ... import comm
from ..topology import ProcessTopology

__all__ = ["SequenceParallelGrid", "initialize_sequence_parallel", "sequence_topology"]


def sequence_topology(world_size: int, sequence_parallel_size: int) -> ProcessTopology:
    """The pure grid: axes ``['data', 'sequence']``, sequence peers adjacent. Raises ``ValueError`` when
    the sizes do not fit."""
    sp = int(sequence_parallel_size)
    if sp < 1:
        raise ValueError(f"sequence_parallel_size must be >= 1, got {sp}")
    if world_size % sp:
        raise ValueError(f"sequence_parallel_size {sp} does not divide the world size {world_size}: set it to a "
                         f"divisor of {world_size}")
    return ProcessTopology(axes=["data", "sequence"], dims=[world_size // sp, sp])


class SequenceParallelGrid:
    """This rank's sequence and data groups (collective to build: every rank constructs it, once)."""

    def __init__(self, sequence_parallel_size: int) -> None:
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        self.topology = sequence_topology(self.world_size, sequence_parallel_size)
        self.sequence_parallel_size = self.topology.get_dim("sequence")
        self.data_parallel_size = self.topology.get_dim("data")
        coord = self.topology.get_coord(self.global_rank)
        self.sequence_parallel_rank, self.data_parallel_rank = coord.sequence, coord.data
        self.sp_ranks, self.sp_group = self._make(self.topology.get_axis_comm_lists("sequence"))
        self.dp_ranks, self.dp_group = self._make(self.topology.get_axis_comm_lists("data"))
        # Every rank of the grid: ZeRO's partition and reduction group. None means the world group.
        self.seq_dp_group: Any = None

    def _make(self, lists: list[list[int]]) -> tuple[list[int], Any]:
        mine: tuple[list[int], Any] = ([], None)
        for ranks in lists:  # every rank creates every group, in the same order
            group = comm.new_group(ranks) if comm.is_initialized() and self.world_size > 1 else None
            if self.global_rank in ranks:
                mine = (ranks, group)
        return mine

    # --- DeepSpeed's parallel_state_sp / groups accessors -------------------------------------------
    def get_sequence_parallel_group(self) -> Any:
        return self.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.sequence_parallel_size

    def get_sequence_parallel_rank(self) -> int:
        return self.sequence_parallel_rank

    def get_sequence_data_parallel_group(self) -> Any:
        return self.seq_dp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.global_rank

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_rank

    def get_model_parallel_world_size(self) -> int:
        """No tensor/pipeline model parallelism here (DeepSpeed's ``parallel_state_sp`` aliases these to the
        sequence group; zerospeed keeps "model parallel" meaning tensor x pipeline)."""
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def initialize_sequence_parallel(sequence_parallel_size: int) -> SequenceParallelGrid:
    """DeepSpeed's ``parallel_state_sp.initialize_sequence_parallel``, returning the grid (no globals kept):
    pass it to ``initialize(mpu=...)``."""
    if sequence_parallel_size < 2:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    return SequenceParallelGrid(sequence_parallel_size)
