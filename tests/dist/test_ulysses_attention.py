"""Ulysses on real Gloo ranks: the sequence<->head all-to-all round-trips (several shapes, odd head counts,
GQA) with the inverse exchange as its backward, and DistributedAttention equals full attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zerospeed import comm
from zerospeed.parallel.sequence.all_to_all import all_to_all_seq_heads, plan_heads
from zerospeed.sequence.layer import DistributedAttention
from zerospeed.testing import run_distributed


def _local(x: torch.Tensor, seq_dim: int) -> torch.Tensor:
    world, rank = comm.get_world_size(), comm.get_rank()
    return x.chunk(world, dim=seq_dim)[rank]


def _round_trip(shape: tuple[int, ...], seq_dim: int, heads: int) -> None:
    world, rank = comm.get_world_size(), comm.get_rank()
    splits = plan_heads(heads, heads, world).q_splits
    full = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    local = _local(full, seq_dim).clone().requires_grad_()
    out = all_to_all_seq_heads(local, None, seq_dim, 2, splits)
    lo = sum(splits[:rank])
    torch.testing.assert_close(out, full.narrow(2, lo, splits[rank]), rtol=0, atol=0)
    back = all_to_all_seq_heads(out, None, seq_dim, 2, splits, to_heads=False)
    torch.testing.assert_close(back, local, rtol=0, atol=0)
    # backward of each exchange is the inverse exchange: d(sum(out * W))/d local = W's slice at my positions
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(8))
    (out * weight.narrow(2, lo, splits[rank])).sum().backward()
    torch.testing.assert_close(local.grad, _local(weight, seq_dim), rtol=0, atol=0)


def _round_trips() -> None:
    world = comm.get_world_size()
    for shape, seq_dim, heads in [((2, 4 * world, 4, 3), 1, 4), ((4 * world, 3, 4, 2), 0, 4),
                                  ((1, 2 * world, 7, 5), 1, 7), ((2 * world, 2, 5, 4), 0, 5),
                                  ((3, world, 2 * world + 1, 1), 1, 2 * world + 1)]:
        _round_trip(shape, seq_dim, heads)


@pytest.mark.parametrize("world", [2, 4])
def test_seq_head_round_trip(world: int) -> None:
    run_distributed(_round_trips, world)


def _sdpa(batch_dim: int):
    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        perm = (0, 2, 1, 3) if batch_dim == 0 else (1, 2, 0, 3)  # -> [b, h, s, d]
        y = F.scaled_dot_product_attention(q.permute(perm), k.permute(perm), v.permute(perm), is_causal=True,
                                           enable_gqa=True)
        return y.permute(0, 2, 1, 3) if batch_dim == 0 else y.permute(2, 0, 1, 3)
    return attn


def _attention(q_heads: int, kv_heads: int, batch_dim: int) -> None:
    world = comm.get_world_size()
    seq_dim = 1 - batch_dim
    s, b, d = 3 * world, 2, 4
    g = torch.Generator().manual_seed(11)
    shape = [b, s] if batch_dim == 0 else [s, b]
    q, k, v = (torch.randn(*shape, h, d, generator=g, requires_grad=True) for h in (q_heads, kv_heads, kv_heads))
    full = _sdpa(batch_dim)(q, k, v)
    w = torch.randn(full.shape, generator=g)
    (full * w).sum().backward()
    lq, lk, lv = (_local(t.detach(), seq_dim).clone().requires_grad_() for t in (q, k, v))
    layer = DistributedAttention(_sdpa(batch_dim), None, gather_idx=seq_dim)
    out = layer(lq, lk, lv, batch_dim)
    torch.testing.assert_close(out, _local(full.detach(), seq_dim), rtol=1e-5, atol=1e-6)
    (out * _local(w, seq_dim)).sum().backward()
    for mine, ref in ((lq, q), (lk, k), (lv, v)):
        torch.testing.assert_close(mine.grad, _local(ref.grad, seq_dim), rtol=1e-5, atol=1e-6)


def _attentions(cases: list[tuple[int, int, int]]) -> None:
    for case in cases:
        _attention(*case)


def test_distributed_attention_equals_full_attention_world2() -> None:
    # MHA even, odd heads (3+2... 5 heads: 3 + 2), GQA even, GQA uneven (3 kv: 2 + 1), one kv head repeated
    run_distributed(_attentions, 2, [(4, 4, 0), (5, 5, 1), (4, 2, 0), (6, 3, 1), (4, 1, 0)])


def test_distributed_attention_world4_gqa_repeat_and_uneven() -> None:
    run_distributed(_attentions, 4, [(8, 2, 0), (5, 5, 1), (12, 6, 0)])


def _bad_heads() -> str:
    layer = DistributedAttention(_sdpa(0), None)
    x = torch.zeros(1, 2, 6, 2)
    try:
        layer(x, torch.zeros(1, 2, 2, 2), torch.zeros(1, 2, 2, 2), 0)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_unsplittable_heads_raise_with_numbers() -> None:
    msgs = run_distributed(_bad_heads, 4)
    assert all("6 query / 2 key-value heads" in m and "size 4" in m for m in msgs), msgs
