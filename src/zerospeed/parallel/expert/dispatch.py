"""Moving routed tokens to the ranks that hold their experts and back: two all-to-alls per forward.

Each rank holds a buffer ``[E experts, C_r slots, M]`` (``C_r`` its own capacity). Expert ``e`` lives on
expert-parallel rank ``e // E_local``, so rank r sends rows ``[j*E_local, (j+1)*E_local)`` to rank j and
receives ``[E_local, C_i, M]`` from every rank i. Capacities may differ between ranks (unequal token
counts), so the splits are uneven and are agreed first with a one-integer all-gather. Experts then see,
for each local expert, the slots of every source rank in rank order::

    sent by r to j:   buf_r[j*E_local : (j+1)*E_local]                 ([E_local, C_r, M])
    expert input:     cat_i(recv_from_i[e_local])                      ([sum_i C_i, M])

The backward of an all-to-all is the all-to-all with the splits swapped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ... import comm
from .tensor_parallel import TensorParallel, drop_tokens, gather_tokens


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: Any, input: Tensor, out_rows: list[int], in_rows: list[int]) -> Tensor:  # type: ignore[override]
        ctx.group, ctx.out_rows, ctx.in_rows = group, out_rows, in_rows
        input = input.contiguous()
        output = input.new_empty((sum(out_rows), *input.shape[1:]))
        comm.all_to_all_single(output, input, out_rows, in_rows, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None, None]:  # type: ignore[override]
        return None, _AllToAll.apply(ctx.group, grad, ctx.in_rows, ctx.out_rows), None, None


def all_to_all(group: Any, input: Tensor, out_rows: list[int], in_rows: list[int]) -> Tensor:
    """Differentiable uneven all-to-all along dim 0."""
    return _AllToAll.apply(group, input, out_rows, in_rows)


def gather_capacities(capacity: int, group: Any, device: torch.device) -> list[int]:
    """Every expert-parallel rank's capacity, in group rank order."""
    world = comm.get_world_size(group)
    mine = torch.tensor([capacity], dtype=torch.int64, device=comm.device_for_backend(group))
    out = torch.empty(world, dtype=torch.int64, device=mine.device)
    comm.all_gather(out, mine, group=group)
    return [int(c) for c in out.tolist()]


def run_experts_parallel(buf: Tensor, experts: Any, group: Any, ep_size: int, tp: TensorParallel | None = None) -> Tensor:
    """``buf`` ``[E, C, M]`` -> expert outputs ``[E, C, M]`` with experts spread over ``group``; with ``tp``
    (expert tensor parallelism) each tensor-parallel rank moves a ``1/tp`` slice of the slots
    (``tensor_parallel.py``)."""
    full = buf
    buf = drop_tokens(buf, 1, tp)
    e, c, m = buf.shape
    local = e // ep_size
    caps = gather_capacities(c, group, buf.device)
    send = [local * c] * ep_size
    recv = [local * ci for ci in caps]
    got = all_to_all(group, buf.reshape(e * c, m), recv, send)                       # [sum_i local*C_i, M]
    per_src = got.split(recv)                                                         # i -> [local*C_i, M]
    per_src = [t.reshape(local, ci, m) for t, ci in zip(per_src, caps)]
    inputs = gather_tokens(torch.cat(per_src, dim=1), 1, tp)                         # [local, sum C_i (x tp), M]
    out = experts(inputs.unsqueeze(0)).reshape(local, inputs.shape[1], m)
    out = drop_tokens(out, 1, tp)                                                     # [local, sum C_i, M]
    back = [t.reshape(local * ci, m) for t, ci in zip(out.split(caps, dim=1), caps)]
    returned = all_to_all(group, torch.cat(back), send, recv)                        # [E*C, M]
    return gather_tokens(returned.reshape(e, c, m), 1, tp).reshape(full.shape)


def encode(tokens: Tensor, expert: Tensor, location: Tensor, num_experts: int, capacity: int) -> Tensor:
    """Place every kept route's token in its slot of a zero ``[E, C, M]`` buffer (one gather)."""
    s, m = tokens.shape
    slots = torch.where(expert >= 0, expert * capacity + location, num_experts * capacity)     # scratch slot
    source = torch.full((num_experts * capacity + 1,), s, dtype=torch.long, device=tokens.device)
    source.scatter_(0, slots.reshape(-1), torch.arange(s, device=tokens.device).expand_as(slots).reshape(-1))
    padded = torch.cat([tokens, tokens.new_zeros(1, m)])
    return padded.index_select(0, source[:-1]).view(num_experts, capacity, m)


def decode(out: Tensor, expert: Tensor, location: Tensor, gate: Tensor) -> Tensor:
    """Each token's weighted sum of its kept routes' expert outputs (accumulated in fp32, as DeepSpeed)."""
    e, c, m = out.shape
    slots = torch.where(expert >= 0, expert * c + location, e * c)
    padded = torch.cat([out.reshape(e * c, m), out.new_zeros(1, m)])
    routed = padded.index_select(0, slots.reshape(-1)).view(*slots.shape, m)
    return (routed * gate.unsqueeze(-1)).sum(0).to(out.dtype)
