"""``zero_optimization.pipeline_loading_checkpoint``: the ranks of a node read a checkpoint one after another.

DeepSpeed 0.19.8 (``engine._load_zero_checkpoint`` and stage 3's ``load_state_dict``): with the key on, local
rank 0 of a node loads its ZeRO-3 partition first and each next local rank waits for its predecessor to
finish (a token passed rank to rank) before it reads, so one rank of a node reads the files at a time. The
"pipeline" is this relay, not pipeline parallelism; DeepSpeed allows it under ZeRO stage 3 only.

Here the relay is a sequence of turns over the load's group: in turn ``t`` the ranks whose local rank is
``t`` (one per node; ranks numbered node-major, as torchrun does) read, then every rank of the group meets at a barrier.
What a rank reads in its turn is the load's staged read (``staged.stage_tensors``: every element range of
the masters and optimizer state it will own), which does no communication, so the barriers cannot
deadlock. A rank whose read fails keeps its error for the load's agreement and still takes part in every
barrier, so the other ranks neither hang nor skip their turns.

DeepSpeed's relay is right on one node only: a rank stops passing the token when its local rank
equals the *world* size minus one, so with several nodes the last local rank of a node sends to the next
node's local rank 0, which never receives it. Here each node runs its own relay, in step with the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ... import comm


def turn_of(rank: int, world: int, ranks_per_node: int) -> int:
    """The turn in which world rank ``rank`` reads: its local rank (ranks numbered node-major)."""
    if ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(f"ranks_per_node ({ranks_per_node}) must divide the world size ({world})")
    return rank % ranks_per_node


def read_in_turns(read: Callable[[], str], group: Any, ranks_per_node: int | None = None) -> str:
    """Collective over ``group``: call ``read`` (no communication inside; it returns an error message, "" on
    success) in this rank's turn; return its message. Every rank of ``group`` takes part in every turn."""
    world = comm.get_world_size()
    per_node = ranks_per_node if ranks_per_node is not None else comm.ranks_per_node_from_env()
    if world % per_node:
        per_node = world  # a layout the launcher did not describe: one node
    mine = turn_of(comm.get_rank(), world, per_node)
    error = ""
    for turn in range(per_node):
        if turn == mine:
            error = read()
        comm.barrier(group)
    return error
