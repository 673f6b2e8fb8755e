"""Expert parallelism on real Gloo ranks: ep=2 equals ep=1, DeepSpeed's group layout, unequal token counts,
and the number of all-to-alls per forward."""

from __future__ import annotations

import torch

from zerospeed import comm
from zerospeed.moe.layer import MoE
from zerospeed.testing import run_distributed


def _expert() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6))


def _full_layer(k: int, **kw) -> MoE:
    torch.manual_seed(0)
    return MoE(6, _expert(), num_experts=4, k=k, ep_size=1, use_rts=False, min_capacity=1,
               top2_2nd_expert_sampling=False, **kw)


def _tokens(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, 6, generator=torch.Generator().manual_seed(100 + rank))


def _ep_equals_local(k: int, counts: list[int], drop_tokens: bool) -> list[tuple[float, float]]:
    """Each rank routes its own tokens; experts live on two ranks. Compare with all experts on this rank."""
    rank = comm.get_rank()
    full = _full_layer(k, capacity_factor=0.75, drop_tokens=drop_tokens)
    ep = MoE(6, _expert(), num_experts=4, k=k, ep_size=2, use_rts=False, min_capacity=1, capacity_factor=0.75,
             top2_2nd_expert_sampling=False, drop_tokens=drop_tokens)
    ep.set_deepspeed_parallelism()
    mine = ep.global_expert_ids()
    assert mine == [2 * rank, 2 * rank + 1]
    with torch.no_grad():  # ep's local experts are the full layer's experts with the same global ids
        ep.deepspeed_moe.gate.wg.weight.copy_(full.deepspeed_moe.gate.wg.weight)
        for local, glob in enumerate(mine):
            for a, b in zip(ep.deepspeed_moe.experts.deepspeed_experts[local].parameters(),
                            full.deepspeed_moe.experts.deepspeed_experts[glob].parameters()):
                a.copy_(b)
    x = _tokens(rank, counts[rank]).requires_grad_()
    comm.COMMS_LOGGER.reset()
    y_ep, l_ep, c_ep = ep(x)
    a2a = comm.COMMS_LOGGER.snapshot()["all_to_all_single"].count
    assert a2a == 2, a2a
    (y_ep.square().sum() + l_ep).backward()
    assert comm.COMMS_LOGGER.snapshot()["all_to_all_single"].count == 4  # backward: two more
    x_ep_grad = x.grad.clone()
    x.grad = None
    y_full, l_full, c_full = full(x) if drop_tokens else (None, None, None)
    if drop_tokens:
        torch.testing.assert_close(y_ep, y_full, rtol=1e-5, atol=1e-6)
        assert torch.equal(c_ep, c_full)
    # expert grads: the sum over both ranks' tokens of the full layer's grads
    if drop_tokens:
        (y_full.square().sum() + l_full).backward()
        for p in full.deepspeed_moe.experts.parameters():  # same order on every rank
            comm.all_reduce(p.grad)
        for local, glob in enumerate(mine):
            for a, b in zip(ep.deepspeed_moe.experts.deepspeed_experts[local].parameters(),
                            full.deepspeed_moe.experts.deepspeed_experts[glob].parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x_ep_grad, x.grad, rtol=1e-5, atol=1e-6)
    return [(float(y_ep.abs().sum()), float(l_ep))]


def test_ep2_equals_ep1_top1_and_top2() -> None:
    run_distributed(_ep_equals_local, 2, 1, [12, 12], True, timeout=60)
    run_distributed(_ep_equals_local, 2, 2, [12, 12], True, timeout=60)


def test_very_unequal_token_counts_do_not_hang() -> None:
    run_distributed(_ep_equals_local, 2, 1, [1, 40], True, timeout=60)
    run_distributed(_ep_equals_local, 2, 2, [0, 33], True, timeout=60)
    run_distributed(_ep_equals_local, 2, 2, [3, 30], False, timeout=60)   # no dropping: capacity agreed (max)


def _no_comm_at_ep1() -> None:
    layer = _full_layer(1)
    layer.set_deepspeed_parallelism()
    comm.COMMS_LOGGER.reset()
    y, l_aux, _ = layer(_tokens(comm.get_rank(), 8))
    (y.sum() + l_aux).backward()
    assert comm.COMMS_LOGGER.snapshot() == {}
    comm.barrier()  # neither rank exits while the other may still be connecting a group it created


def test_no_communication_at_ep1() -> None:
    run_distributed(_no_comm_at_ep1, 2, timeout=60)


def _layout(data_before_expert: bool) -> tuple[list[int], list[int]]:
    layer = MoE(6, _expert(), num_experts=4, ep_size=2)
    registry: dict = {}
    layer.set_deepspeed_parallelism(data_before_expert, registry=registry)
    other = MoE(6, _expert(), num_experts=2, ep_size=2)
    other.set_deepspeed_parallelism(data_before_expert, registry=registry)
    assert other.expert_groups is layer.expert_groups  # one set of groups per ep_size
    g = layer.expert_groups
    t = torch.tensor([float(comm.get_rank())])
    comm.all_reduce(t, group=g.ep_group)                  # the groups really are those ranks
    assert float(t) == sum(g.ep_ranks)
    return g.ep_ranks, g.edp_ranks


def test_group_layout_matches_deepspeed() -> None:
    got = run_distributed(_layout, 4, False, timeout=60)
    assert got == [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])]
    got = run_distributed(_layout, 4, True, timeout=60)
    assert got == [([0, 2], [0, 1]), ([1, 3], [0, 1]), ([0, 2], [2, 3]), ([1, 3], [2, 3])]
