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

from .moe_fixtures import ADAM_EPS, MoEGPT, batch, engine_config, reference

STEPS, MB, LR, ADAM_LR = 10, 2, 0.5, 0.01


def _train(ep: int, k: int, stage: int, clip: float, data_before: bool = False, offload: bool = False,
           adam: bool = False, offload_param: str = "none", swap_dir: str = "") -> tuple:
    rank, world = comm.get_rank(), comm.get_world_size()
    # DeepSpeed's layout: expert-parallel peers adjacent; "data before expert": expert-data peers adjacent
    ep_rank = rank // (world // ep) if data_before else rank % ep
    model = MoEGPT(ep, k, ep_rank)
    cfg = engine_config(stage, clip, LR, MB, world)
    cfg["use_data_before_expert_parallelism"] = data_before
    if offload:  # True: host memory; "nvme": swap files (gradients streamed to them at stages 2-3)
        device = "cpu" if offload is True else offload
        cfg["zero_optimization"]["offload_optimizer"] = {"device": device, "nvme_path": swap_dir}
    if offload_param != "none":  # ZeRO-Infinity: stage-3 shards (experts' too) live in host memory / swap files
        cfg["zero_optimization"]["offload_param"] = {"device": offload_param, "nvme_path": swap_dir}
    if adam:  # DeepSpeed's "Adam" (adam_w_mode, no weight decay: Adam); the fast CPU kernel under offload
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": ADAM_LR, "eps": ADAM_EPS}}
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    assert (engine.optimizer.stepper is not None) == bool(offload)
    groups = model.gpt.blocks[0].mlp.moe.expert_groups
    assert model.gpt.blocks[0].mlp.moe.global_expert_ids()[0] == ep_rank * (4 // ep)
    if stage == 3:  # experts cut over their expert-data group (whole when it has one rank), dense over all
        from zerospeed.zero.stage3 import shard_of

        expert, dense = shard_of(next(model.expert(0, 0).parameters())), shard_of(model.gpt.wte.weight)
        whole = groups.edp_size == 1 and offload_param == "none"  # an offloaded one is a one-piece shard
        assert (expert.world, expert.persistent, dense.world) == (groups.edp_size, whole, world)
        assert (expert.home is not None) == (offload_param != "none")
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
    with zerospeed.zero.GatheredParameters(list(model.parameters())):  # whole under stage 3
        state = _state(model)
    return losses, state, float(engine.get_global_grad_norm() or 0.0), grads


def _state(model: MoEGPT) -> dict[str, torch.Tensor]:
    """Experts by global id, dense by name."""
    state = {n: p.detach().clone() for n, p in model.named_parameters() if not is_moe_param(p)}
    for layer in range(len(model.gpt.blocks)):
        moe = model.gpt.blocks[layer].mlp.moe
        for local, gid in enumerate(moe.global_expert_ids()):
            for n, p in model.expert(layer, local).named_parameters():
                state[f"L{layer}.E{gid}.{n}"] = p.detach().clone()
    return state


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


def _check(results: list, world: int, k: int, clip: float, adam: bool = False) -> None:
    ref_losses, ref, ref_grads = reference(STEPS, world, MB, k, clip, ADAM_LR if adam else LR, adam=adam)
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


@pytest.mark.parametrize("ep,k", [(2, 1), (1, 2)])
def test_world2_zero3(ep: int, k: int) -> None:
    """Dense parameters partitioned over the data-parallel group; experts over their expert-data group (ep=1:
    both ranks; ep=2: a group of one, so each rank keeps its experts whole)."""
    _check(run_distributed(_train, 2, ep, k, 3, 0.0, timeout=120), 2, k, 0.0)


def test_world4_ep2_dp2_zero3_clipping() -> None:
    """Experts partitioned over expert-data groups of two ([0, 2], [1, 3]): gathered by their own group."""
    results = run_distributed(_train, 4, 2, 2, 3, 0.05, timeout=180)
    _check(results, 4, 2, 0.05)
    assert len({round(r[2], 6) for r in results}) == 1


@pytest.mark.parametrize("world,ep,device", [(2, 2, "cpu"), (4, 2, "cpu"), (2, 1, "nvme")])
def test_zero3_offload_param(tmp_path, world: int, ep: int, device: str) -> None:
    """ZeRO-Infinity: dense shards and expert shards (cut over their expert-data group; a group of one keeps a
    one-piece shard) offloaded to host memory or swap files, with the optimizer offloaded too."""
    results = run_distributed(_train, world, ep, 1, 3, 0.05, False, True, False, device, str(tmp_path), timeout=180)
    _check(results, world, 1, 0.05)


@pytest.mark.parametrize("world,stage", [(2, 2), (2, 3), (4, 2)])
def test_nvme_optimizer_offload(tmp_path, world: int, stage: int) -> None:
    """Adam: masters, optimizer state and (streamed) gradients in swap files; the norm from the squares recorded per
    group as the gradients were written (dense and expert sets apart), clipping on."""
    results = run_distributed(_train, world, 2, 1, stage, 0.05, False, "nvme", True, "none", str(tmp_path),
                              timeout=180)
    _check(results, world, 1, 0.05, adam=True)  # nvme streams Adam's state (SGD has no flat kernel)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_world2_ep2_offload_optimizer(stage: int) -> None:
    """ZeRO-Offload: expert and dense masters (and the optimizer step) on the host, clipping on."""
    _check(run_distributed(_train, 2, 2, 1, stage, 0.05, False, True, timeout=120), 2, 1, 0.05)


def test_world4_ep2_dp2_zero2_offload_optimizer_cpu_adam() -> None:
    _check(run_distributed(_train, 4, 2, 2, 2, 0.0, False, True, True, timeout=180), 4, 2, 0.0, adam=True)


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


class _Tiny(torch.nn.Module):
    """A dense linear layer in front of an MoE layer; loss = sum of squared outputs (0 for no tokens)."""

    def __init__(self, ep: int, ep_rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        expert = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6))
        self.lin = torch.nn.Linear(6, 6)
        self.moe = zerospeed.moe.layer.MoE(6, expert, 4, ep, k=2, min_capacity=1, use_rts=False,
                                           top2_2nd_expert_sampling=False)
        full = [torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6)) for _ in range(4)]
        with torch.no_grad():
            for local, e in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                for a, b in zip(e.parameters(), full[ep_rank * (4 // ep) + local].parameters()):
                    a.copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _, _ = self.moe(self.lin(x))
        return y.square().sum()


def _tokens(step: int) -> torch.Tensor:
    return torch.randn(10, 6, generator=torch.Generator().manual_seed(50 + step))


def _zero_tokens(ep: int, stage: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Rank 0 routes no tokens at all (an empty batch), rank 1 ten: every step finishes on both."""
    rank = comm.get_rank()
    model = _Tiny(ep, rank % ep)
    engine, *_ = zerospeed.initialize(model=model, config=engine_config(stage, 0.0, 0.05, 1, 2))
    losses = []
    for step in range(3):
        loss = engine(_tokens(step)[: 0 if rank == 0 else 10])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    with zerospeed.zero.GatheredParameters(list(model.parameters())):
        state = {n: p.detach().clone() for n, p in model.named_parameters() if not is_moe_param(p)}
        for local, gid in enumerate(model.moe.global_expert_ids()):
            for n, p in model.moe.deepspeed_moe.experts.deepspeed_experts[local].named_parameters():
                state[f"E{gid}.{n}"] = p.detach().clone()
    return losses, state


@pytest.mark.parametrize("ep,stage", [(2, 3), (1, 3), (2, 2)])
def test_a_rank_routing_no_tokens_finishes_the_step(ep: int, stage: int) -> None:
    ref = _Tiny(1, 0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    ref_losses = []
    for step in range(3):
        opt.zero_grad()
        loss = ref(_tokens(step))
        (loss / 2).backward()  # averaged with rank 0's zero loss
        opt.step()
        ref_losses.append(float(loss.detach()))
    want = {n: p for n, p in ref.named_parameters() if not is_moe_param(p)}
    for gid, e in enumerate(ref.moe.deepspeed_moe.experts.deepspeed_experts):
        want.update({f"E{gid}.{n}": p for n, p in e.named_parameters()})
    results = run_distributed(_zero_tokens, 2, ep, stage, timeout=120)
    assert results[0][0] == [0.0] * 3
    assert results[1][0] == pytest.approx(ref_losses, rel=1e-5)
    for _, state in results:
        for name, value in state.items():
            torch.testing.assert_close(value, want[name].detach(), rtol=1e-5, atol=1e-6, msg=name)


def _under_zero_init() -> str:
    cfg = engine_config(3, 0.0, LR, MB, comm.get_world_size())
    with zerospeed.zero.Init(config_dict_or_path=cfg):
        model = MoEGPT(2, 1, comm.get_rank())  # experts cut over the world by zero.Init: rank 1's would be lost
    try:
        zerospeed.initialize(model=model, config=cfg)
    except ValueError as exc:
        return str(exc)
    return ""


def test_ep2_model_built_under_zero_init_is_refused() -> None:
    assert all("zero.Init" in m for m in run_distributed(_under_zero_init, 2, timeout=60))
