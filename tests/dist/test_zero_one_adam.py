"""0/1 Adam through the engine at world 2: the gradient all-reduce runs only on variance-update steps, the
other steps move 1-bit traffic only, ranks agree after each synchronisation, and it converges like Adam."""

from __future__ import annotations

import math
from typing import Any

import torch

from zerospeed.testing import run_distributed

from .test_onebit_adam import run_bytes

ZO = {"lr": 3e-3, "var_freeze_step": 12, "var_update_scaler": 2, "local_step_scaler": 4, "local_step_clipper": 2}


def test_allreduce_only_on_variance_steps_then_one_bit() -> None:
    results = run_distributed(run_bytes, 2, 0, 20, {"type": "ZeroOneAdam", "params": ZO}, timeout=120)
    steps = results[0]["per_step"]
    full = [bool(s.get("all_reduce", 0)) for s in steps]
    # calls 1-4 all-reduce (interval 1, then 2 from step 4), then 6, 8 (interval 4 from step 6: 12), none after
    assert full[:13] == [True, True, True, True, False, True, False, True, False, False, False, True, False]
    assert not any(full[13:])
    warm = steps[0]["all_reduce"]
    for s in steps[13:]:  # local steps: interval 1 then 2 (local_step_scaler 4, clipper 2)
        one_bit = s.get("all_to_all", 0) + s.get("all_gather", 0)
        assert one_bit <= warm / 25
    assert sum(1 for s in steps[13:] if s.get("all_to_all", 0)) < len(steps[13:]), "some steps are purely local"
    # the last step (20) is a synchronising one (20 % 2 == 0): every rank holds the same weights, up to the
    # rounding of undoing its own local steps (p + sum(local) - sum(local)), as in DeepSpeed
    for k, v in results[0]["state"].items():
        torch.testing.assert_close(results[1]["state"][k], v, rtol=0, atol=1e-6)


def test_converges_like_adam() -> None:
    params = {**ZO, "var_freeze_step": 30, "var_update_scaler": 4, "local_step_scaler": 8, "local_step_clipper": 4}
    zo = run_distributed(run_bytes, 2, 0, 80, {"type": "ZeroOneAdam", "params": params}, timeout=200)[0]["losses"]
    adam = run_distributed(run_bytes, 2, 0, 80, {"type": "Adam", "params": {"lr": 3e-3}}, timeout=200)[0]["losses"]
    tail_zo, tail_adam = sum(zo[-10:]) / 10, sum(adam[-10:]) / 10
    assert tail_zo < zo[0] / 5
    assert tail_zo <= 1.25 * tail_adam, (tail_zo, tail_adam)


# --- zerospeed_bias_correction (zerospeed only) ------------------------------------------------------------

ZBC = {"lr": 3e-3, "var_freeze_step": 100, "var_update_scaler": 100, "zerospeed_bias_correction": True}


def test_bias_corrected_warmup_equals_torch_adam_at_world_2() -> None:
    """Before any compression (var_interval 1, so every step all-reduces) the update is torch Adam's on the
    global batch, after 0/1 Adam's initialising first call (rtol 1e-6; atol for the all-reduce's order)."""
    from .test_onebit_adam import Wide

    steps = 5
    results = run_distributed(run_bytes, 2, 0, steps, {"type": "ZeroOneAdam", "params": ZBC}, timeout=120)
    model = Wide()
    adam = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(steps):
        xs = [torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(2)]
        model.zero_grad()
        loss = sum(model(x) for x in xs) / 2
        loss.backward()
        if step > 0:
            adam.step()
    for r in results:
        for k, v in model.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-6, atol=1e-6, msg=f"parameter {k}")


ZBC_SIM = {"lr": 0.01, "var_update_scaler": 2, "var_freeze_step": 7, "local_step_scaler": 2, "local_step_clipper": 2}
SIM_STEPS, SIM_SHAPES = 13, [(5, 3), (37,)]


def sim_grads(call: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * call + rank)
    return [torch.randn(s, generator=g) for s in SIM_SHAPES]


def sim_params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SIM_SHAPES]


def run_direct() -> dict[str, Any]:
    """ZeroOneAdam driven by hand at world 2: on steps it wants all-reduced, both ranks get the mean gradient."""
    from zerospeed import comm
    from zerospeed.optim.onebit import ZeroOneAdam

    rank = comm.get_rank()
    ps = [torch.nn.Parameter(p) for p in sim_params()]
    opt = ZeroOneAdam(ps, **ZBC_SIM, zerospeed_bias_correction=True)
    for call in range(SIM_STEPS):
        if opt.wants_backward_allreduce():
            grads = [(a + b) * 0.5 for a, b in zip(sim_grads(call, 0), sim_grads(call, 1))]
        else:
            grads = sim_grads(call, rank)
        for p, g in zip(ps, grads):
            p.grad = g
        opt.step()
    return {"params": [p.detach().clone() for p in ps], "exp_avg": [opt.state[p]["exp_avg"].clone() for p in ps]}


def simulate_zbc(world: int = 2) -> list[dict[str, list[torch.Tensor]]]:
    """The same in one process: per-rank weights and moments, the 1-bit all-reduce simulated
    (``test_compressed_allreduce.simulate_call``), error buffers per parameter, fresh at the local phase."""
    from .test_compressed_allreduce import fresh_errors, simulate_call

    b1, b2, eps, lr = 0.9, 0.999, 1e-8, ZBC_SIM["lr"]
    p = [sim_params() for _ in range(world)]
    m = [[torch.zeros(s) for s in SIM_SHAPES] for _ in range(world)]
    v = [[torch.zeros(s) for s in SIM_SHAPES] for _ in range(world)]
    acc = [[torch.zeros(s) for s in SIM_SHAPES] for _ in range(world)]
    errors = [fresh_errors(math.prod(s), world) for s in SIM_SHAPES]
    k, interval, counter, lsi, lsc, lrs = 0, 1, 0, 1, 0, [0.0] * world
    for call in range(SIM_STEPS):
        step, gs = call + 1, [sim_grads(call, r) for r in range(world)]
        if step == 1:
            continue
        frozen = step - 1 > ZBC_SIM["var_freeze_step"]
        if frozen and step - 2 <= ZBC_SIM["var_freeze_step"]:
            errors = [fresh_errors(math.prod(s), world) for s in SIM_SHAPES]
        var_step = not frozen and step % interval == 0
        k += var_step
        for i in range(len(SIM_SHAPES)):
            if var_step:
                ga = (gs[0][i] + gs[1][i]) * 0.5
            elif not frozen:
                ga = simulate_call([gs[r][i].clone() for r in range(world)], *errors[i])
            for r in range(world):
                if not frozen:
                    if var_step:
                        v[r][i].mul_(b2).addcmul_(ga, ga, value=1 - b2)
                    m[r][i].mul_(b1).add_(ga, alpha=1 - b1)
                    mh = m[r][i] / (1 - b1 ** (step - 1))
                else:
                    m[r][i].mul_(b1).add_(gs[r][i], alpha=1 - b1)
                    mh = m[r][i]
                denom = (v[r][i] / (1 - b2 ** max(1, k))).sqrt() + eps
                update = mh / denom
                p[r][i].add_(-lr * update)
                if frozen:
                    acc[r][i].add_(-lr * update)
            if frozen and step % lsi == 0:  # synchronise: undo local steps, average them in momentum units
                for r in range(world):
                    p[r][i].add_(-1 * acc[r][i])
                    acc[r][i].mul_(denom)
                avg = simulate_call([acc[r][i].clone() for r in range(world)], *errors[i])
                for r in range(world):
                    m[r][i].zero_().add_(avg / (lrs[r] + lr), alpha=-1)
                    p[r][i].add_(avg / denom)
                    acc[r][i].zero_()
        if frozen:
            lrs = [x + lr for x in lrs]
            if step % lsi == 0:
                lrs = [0.0] * world
            lsc += 1
            if lsc == ZBC_SIM["local_step_scaler"]:
                lsc, lsi = 0, min(ZBC_SIM["local_step_clipper"], lsi * 2)
        elif var_step:
            counter += 1
            if counter == ZBC_SIM["var_update_scaler"]:
                counter, interval = 0, interval * 2
    return [{"params": p[r], "exp_avg": m[r]} for r in range(world)]


def test_bias_corrected_compressed_path_equals_simulation() -> None:
    """Variance updates with doubling intervals, 1-bit momentum steps, then local steps with 1-bit
    synchronisation (error feedback carried across calls): equal to the one-process simulation."""
    results = run_distributed(run_direct, 2, timeout=60)
    expected = simulate_zbc()
    for rank, (got, want) in enumerate(zip(results, expected)):
        for what in ("params", "exp_avg"):
            for i, (a, b) in enumerate(zip(got[what], want[what])):
                assert torch.equal(a, b), f"rank {rank} {what}[{i}]"
    gap = (results[0]["params"][1] - results[1]["params"][1]).abs().max()
    assert gap > 1e-4, "step 13 was local: the ranks differ until the next synchronisation"
