"""MoE training under the engine equals plain single-process PyTorch at ep=1 and ep=2, ZeRO 0/1/2, world 2 and 4.

The reference routes each rank's micro-batch on its own (capacity and the aux loss are per rank, as on
that rank) and averages the per-rank losses, as data parallelism does. SGD makes a weight's update its
gradient, so equal weights after every step mean equal gradients (expert gradients included)."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from zerospeed import comm
from zerospeed.moe.utils import is_moe_param
from zerospeed.testing import run_distributed

from .moe_fixtures import MoEGPT, batch, engine_config, reference

STEPS, MB, LR = 10, 2, 0.5


def _train(ep: int, k: int, stage: int, clip: float, data_before: bool = False) -> tuple:
    rank, world = comm.get_rank(), comm.get_world_size()
    # DeepSpeed's layout: expert-parallel peers adjacent; "data before expert": expert-data peers adjacent
    ep_rank = rank // (world // ep) if data_before else rank % ep
    model = MoEGPT(ep, k, ep_rank)
    cfg = engine_config(stage, clip, LR, MB, world)
    cfg["use_data_before_expert_parallelism"] = data_before
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    groups = model.gpt.blocks[0].mlp.moe.expert_groups
    assert model.gpt.blocks[0].mlp.moe.global_expert_ids()[0] == ep_rank * (4 // ep)
    if data_before and world == 4:
        assert (groups.ep_ranks, groups.edp_ranks) == ([rank % 2, rank % 2 + 2], [rank // 2 * 2, rank // 2 * 2 + 1])
    losses, grads = [], {}
    for step in range(STEPS):
        loss = engine(*batch(step, rank, MB))
        engine.backward(loss)
        if step == 0 and stage == 0:
            grads = _expert_grads(engine, model)
        engine.step()
        losses.append(float(loss))
    # experts by global id, dense by name
    state = {n: p.detach().clone() for n, p in model.named_parameters() if not is_moe_param(p)}
    for layer in range(len(model.gpt.blocks)):
        moe = model.gpt.blocks[layer].mlp.moe
        for local, gid in enumerate(moe.global_expert_ids()):
            for n, p in model.expert(layer, local).named_parameters():
                state[f"L{layer}.E{gid}.{n}"] = p.detach().clone()
    return losses, state, float(engine.get_global_grad_norm() or 0.0), grads


def _expert_grads(engine, model: MoEGPT) -> dict[str, torch.Tensor]:
    """Step-0 reduced expert gradients by global id, read from the (unpartitioned) stage-0 buffers."""
    where = {}
    for gi, grp in enumerate(engine.optimizer.groups):
        buf = engine.optimizer.reducer.partition_buffer(gi)
        for i, p in enumerate(grp.params):
            where[id(p)] = grp.slot_view(buf, i).reshape(p.shape).clone()
    out = {}
    for layer in range(len(model.gpt.blocks)):
        for local, gid in enumerate(model.gpt.blocks[layer].mlp.moe.global_expert_ids()):
            for n, p in model.expert(layer, local).named_parameters():
                out[f"L{layer}.E{gid}.{n}"] = where[id(p)]
    return out


def _check(results: list, world: int, k: int, clip: float) -> None:
    ref_losses, ref, ref_grads = reference(STEPS, world, MB, k, clip, LR)
    ref_state = {n: p for n, p in ref.named_parameters() if not is_moe_param(p)}
    for layer in range(len(ref.gpt.blocks)):
        for gid in range(4):
            for n, p in ref.expert(layer, gid).named_parameters():
                ref_state[f"L{layer}.E{gid}.{n}"] = p
    for rank, (losses, state, _, grads) in enumerate(results):
        assert losses == pytest.approx([r[rank] for r in ref_losses], rel=1e-5, abs=1e-6)
        for name, value in state.items():  # after 10 steps at lr 0.5: rounding differences grow to ~4e-6
            torch.testing.assert_close(value, ref_state[name].detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m, name=name: f"grad {name}: {m}")
    seen = {n for _, state, _, _ in results for n in state if ".E" in n}
    assert len(seen) == 2 * 4 * 4  # every global expert checked somewhere (2 layers x 4 experts x 4 tensors)


@pytest.mark.parametrize("ep,k,stage", [(1, 1, 0), (2, 1, 0), (2, 2, 1), (2, 1, 2), (1, 2, 0), (2, 2, 0)])
def test_world2(ep: int, k: int, stage: int) -> None:
    results = run_distributed(_train, 2, ep, k, stage, 0.0, timeout=120)
    if stage == 0:
        assert all(len(r[3]) == 2 * 4 * 4 // ep for r in results)  # expert grads read on every rank
    _check(results, 2, k, 0.0)


def test_world2_ep2_clipping_uses_the_true_norm() -> None:
    results = run_distributed(_train, 2, 2, 1, 2, 0.05, timeout=120)
    _check(results, 2, 1, 0.05)
    assert results[0][2] == pytest.approx(results[1][2], rel=1e-6)


def test_world4_ep2_dp2_zero2() -> None:
    _check(run_distributed(_train, 4, 2, 2, 2, 0.0, timeout=180), 4, 2, 0.0)


def test_world4_data_before_expert_config_key() -> None:
    _check(run_distributed(_train, 4, 2, 1, 1, 0.0, True, timeout=180), 4, 1, 0.0)


def _client_optimizer(mixed: bool) -> tuple[list[float], dict[str, torch.Tensor], float, dict]:
    from zerospeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    rank, world = comm.get_rank(), comm.get_world_size()
    model = MoEGPT(2, 1, rank % 2)
    if mixed:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    else:
        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                       "name": "dense"})
        assert [g.get("moe", False) for g in groups] == [False, True]
        opt = torch.optim.SGD(groups, lr=LR)
    cfg = engine_config(2, 0.0, LR, MB, world)
    del cfg["optimizer"]
    try:
        engine, *_ = zerospeed.initialize(model=model, optimizer=opt, config=cfg)
    except ValueError as exc:
        return [], {}, 0.0, {"error": str(exc)}
    losses = []
    for step in range(STEPS):
        loss = engine(*batch(step, rank, MB))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    state = {n: p.detach().clone() for n, p in model.named_parameters() if not is_moe_param(p)}
    for layer in range(len(model.gpt.blocks)):
        for local, gid in enumerate(model.gpt.blocks[layer].mlp.moe.global_expert_ids()):
            for n, p in model.expert(layer, local).named_parameters():
                state[f"L{layer}.E{gid}.{n}"] = p.detach().clone()
    return losses, state, 0.0, {}


def test_client_optimizer_with_deepspeeds_moe_param_groups() -> None:
    _check(run_distributed(_client_optimizer, 2, False, timeout=120), 2, 1, 0.0)
    errors = run_distributed(_client_optimizer, 2, True, timeout=120)
    assert all("split_params_into_different_moe_groups_for_optimizer" in r[3]["error"] for r in errors)


def _train_gas(stage: int, gas: int) -> tuple:
    rank, world = comm.get_rank(), comm.get_world_size()
    model = MoEGPT(2, 1, rank % 2)
    engine, *_ = zerospeed.initialize(model=model, config=engine_config(stage, 0.0, LR, MB, world, gas))
    losses = []
    for micro in range(4 * gas):
        loss = engine(*batch(micro, rank, MB))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    state = {n: p.detach().clone() for n, p in model.named_parameters() if not is_moe_param(p)}
    for layer in range(len(model.gpt.blocks)):
        for local, gid in enumerate(model.gpt.blocks[layer].mlp.moe.global_expert_ids()):
            for n, p in model.expert(layer, local).named_parameters():
                state[f"L{layer}.E{gid}.{n}"] = p.detach().clone()
    return losses, state


@pytest.mark.parametrize("stage", [1, 2])
def test_gradient_accumulation_ep2(stage: int) -> None:
    gas = 2
    ref_losses, ref, _ = reference(4, 2, MB, 1, 0.0, LR, gas)
    for rank, (losses, state) in enumerate(run_distributed(_train_gas, 2, stage, gas, timeout=120)):
        assert losses == pytest.approx([r[rank] for r in ref_losses], rel=1e-5, abs=1e-6)
        for name, value in state.items():
            if ".E" in name:
                layer, gid, rest = name[1], int(name.split(".E")[1].split(".")[0]), name.split(".", 2)[2]
                want = dict(ref.expert(int(layer), gid).named_parameters())[rest]
            else:
                want = dict(ref.named_parameters())[name]
            torch.testing.assert_close(value, want.detach(), rtol=1e-5, atol=1e-5, msg=name)
