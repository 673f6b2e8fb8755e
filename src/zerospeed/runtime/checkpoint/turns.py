"""``zero_optimization.pipeline_loading_checkpoint``: the ranks of a node read a checkpoint one after another.

DeepSpeed 0.19.8 (``engine._load_zero_checkpoint`` and stage 3's ``load_state_dict``): with the key on, local
rank 0 of a node loads its ZeRO-3 partition first and each next local rank waits for its predecessor to
finish (a token passed rank to rank) before it reads, so one rank of a node reads the files at a time. The
"pipeline" is this relay, not pipeline parallelism; DeepSpeed allows it under ZeRO stage 3 only.

Here the relay is a sequence of turns over the load's group: in turn ``t`` the ranks whose local rank is
``t`` (one per node; ranks numbered node-major, as torchrun does) work, then every rank of the group meets at
a barrier. The load stays staged and atomic where it can be: before any turn, every range a rank will read is
checked against the checkpoint's index (``staged.stage_tensors(keep=False)``), and the ranks agree. In its
turn a rank reads its ranges into memory, writes its fp32 masters and optimizer state from them and drops the
read copy (:func:`relay_turn`, no communication inside, so the barriers cannot deadlock); so, as in DeepSpeed,
one rank of a node holds a read copy at a time, not all of them. The parameter shards are written from the
masters after the last turn (``finish_params``: stage 3's persistent parameters take one all-gather). A rank
whose turn fails keeps its error and still takes part in every barrier; the ranks agree on it after the turns.

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


def relay_turn(ctx: Any, groups: list[Any], optimizer: Any, from_fp32: bool) -> str:
    """One rank's turn: read its staged ranges, write its masters (``ctx.sharded``: the stage-3 groups whose
    shards follow) and optimizer state (``ctx.optimizer_state_loaded``), drop the read copy; "" or the error."""
    from . import staged
    from .universal import load_optimizer_state, owned_params, write_masters

    try:
        staged.stage_tensors(ctx.reader, list(owned_params(groups, ctx.names)), ctx.layout)
        ctx.sharded = write_masters(groups, ctx.names, ctx.reader, from_fp32)
        if ctx.layout is not None and optimizer is not None and ctx.load_optimizer_states:
            load_optimizer_state(groups, ctx.names, ctx.reader, ctx.layout, optimizer.optimizer)
            ctx.optimizer_state_loaded = True
    except Exception as exc:  # noqa: BLE001 - agreed on by every rank after the turns
        return f"{type(exc).__name__}: {exc}"
    finally:
        ctx.reader.release()
    return ""
