"""``gradient_compression.momentum_exchange`` through the engine at world 2 equals a one-process simulation: dense
Adam for the warm-up, then each rank's error-compensated ``beta1 * m + (1 - beta1) * g_r`` is top-k exchanged
(per rank, or exact at the union of the indices) and drives Adam with its variance frozen."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.comm.sparse import topk_count
from zerospeed.testing import run_distributed

from .test_onebit_adam import Wide

WARM, STEPS, RATIO, LR, BETAS, EPS = 2, 6, 0.05, 3e-3, (0.9, 0.999), 1e-8
COMPRESSION = {"type": "topk", "ratio": RATIO, "warmup_steps": WARM, "freeze_variance": True, "momentum_exchange": True}


def data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + rank))


def config(union: bool, local: bool = False) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000, "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": LR}},
            "gradient_compression": {**COMPRESSION, "union_indices": union, "local_variance": local}}


def run(union: bool, save_at: int | None = None, ckpt: str = "", local: bool = False) -> dict[str, Any]:
    """Train STEPS steps; with ``save_at``, save after that many steps and let a fresh engine load and finish."""
    import zerospeed
    from zerospeed import comm

    rank = comm.get_rank()
    model = Wide()
    engine, _, _, _ = zerospeed.initialize(model=model, config=config(union, local))
    per_step = []
    for step in range(STEPS):
        if save_at is not None and step == save_at:
            engine.save_checkpoint(ckpt, tag="t")
            model = Wide()
            engine, _, _, _ = zerospeed.initialize(model=model, config=config(union, local))
            engine.load_checkpoint(ckpt, tag="t")
        before = comm.COMMS_LOGGER.snapshot()
        loss = engine(data(step, rank))
        engine.backward(loss)
        engine.step()
        after = comm.COMMS_LOGGER.snapshot()
        per_step.append({op: after[op].bytes - (before[op].bytes if op in before else 0) for op in after})
    return {"per_step": per_step, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def exchange(xs: list[torch.Tensor], errors: list[torch.Tensor], k: int, union: bool) -> torch.Tensor:
    """The averaged sparse momentum of both ranks; ``errors`` keep what was not sent."""
    accs = [e.add_(x) for e, x in zip(errors, xs)]
    picks = [torch.topk(a.abs(), k, sorted=False).indices for a in accs]
    total = torch.zeros_like(xs[0])
    if union:
        chosen = torch.zeros(xs[0].numel(), dtype=torch.bool)
        for idx in picks:
            chosen[idx] = True
        picks = [chosen.nonzero().squeeze(1)] * 2
        total[picks[0]] = accs[0][picks[0]] + accs[1][picks[0]]
    else:
        for a, idx in zip(accs, picks):
            total.index_add_(0, idx, a[idx])
    for a, idx in zip(accs, picks):
        a[idx] = 0.0
    return total * 0.5


def simulate(union: bool, reset_at: int | None = None, local: bool = False) -> dict[str, torch.Tensor]:
    """One process, both ranks' gradients from the same replica; ``reset_at``: error buffers zeroed there;
    ``local``: each rank's own live variance, the preconditioned momentum exchanged (``local_variance``)."""
    model = Wide()
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=LR, betas=BETAS, eps=EPS)
    n = sum(p.numel() for p in params)
    errors = [torch.zeros(n), torch.zeros(n)]
    for step in range(STEPS):
        if step == reset_at:
            errors = [torch.zeros(n), torch.zeros(n)]
        grads = []
        for rank in range(2):
            model.zero_grad()
            model(data(step, rank)).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        if step < WARM:
            avg = (grads[0] + grads[1]) * 0.5
            for p, g in zip(params, avg.split([p.numel() for p in params])):
                p.grad = g.view_as(p).clone()
            opt.step()
            continue
        m = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in params])
        if local:
            t = int(opt.state[params[0]]["step"]) + 1
            if t - 1 == WARM:  # from Adam's momentum and variance: each rank's variance, the shared step u
                variances = [torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in params]) for _ in grads]
                m = m / ((variances[0] / (1 - BETAS[1] ** WARM)).sqrt() + EPS)
            for r, g in enumerate(grads):
                variances[r].mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
                grads[r] = g / (variances[r] / (1 - BETAS[1] ** t)).sqrt_().add_(EPS)
        xs = [m.clone().mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0]) for g in grads]
        avg = exchange(xs, errors, topk_count(n, RATIO), union)
        if local:
            with torch.no_grad():
                for p, up in zip(params, avg.split([p.numel() for p in params])):
                    opt.state[p]["step"] += 1
                    opt.state[p]["exp_avg"].copy_(up.view_as(p))
                    p.add_(opt.state[p]["exp_avg"], alpha=-LR)
            continue
        with torch.no_grad():  # 1-bit Adam's rule: the exchanged momentum is exp_avg; the variance frozen
            for p, mp in zip(params, avg.split([p.numel() for p in params])):
                st = opt.state[p]
                st["step"] += 1
                st["exp_avg"].copy_(mp.view_as(p))
                denom = (st["exp_avg_sq"].sqrt() / (1 - BETAS[1] ** WARM) ** 0.5).add_(EPS)
                p.addcdiv_(st["exp_avg"], denom, value=-LR)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("union", [False, True])
def test_momentum_exchange_equals_simulation(union: bool) -> None:
    results = run_distributed(run, 2, union, timeout=120)
    want = simulate(union)
    for r in results:
        for key, v in want.items():
            torch.testing.assert_close(r["state"][key], v, rtol=1e-6, atol=1e-7)
    # error feedback matters: a simulation that drops unsent entries differs
    assert any(not torch.allclose(results[0]["state"][key], v, rtol=1e-6, atol=1e-7)
               for key, v in simulate(union, reset_at=WARM + 1).items())
    n, k = 4096, topk_count(4096, RATIO)
    for s in results[0]["per_step"][:WARM]:  # dense warm-up: the fp32 gradient all-reduce
        assert s["all_reduce"] >= 4 * n
    for s in results[0]["per_step"][WARM:]:
        if union:  # k indices from each rank, then the values at the union (at most 2k), summed
            assert s["all_gather"] == 2 * k * 4 and s["all_reduce"] <= 2 * k * 4 + 4
        else:  # k indices and k values from each rank; no gradient all-reduce (4 bytes: the commit flag)
            assert s["all_gather"] == 2 * 2 * k * 4 and s.get("all_reduce", 0) <= 8


@pytest.mark.parametrize("union", [False, True])
def test_local_variance_equals_simulation(union: bool) -> None:
    """``local_variance``: each rank's own live variance preconditions its gradient; the step is exchanged."""
    results = run_distributed(run, 2, union, None, "", True, timeout=120)
    want = simulate(union, local=True)
    for r in results:
        for key, v in want.items():
            torch.testing.assert_close(r["state"][key], v, rtol=1e-6, atol=1e-7)
    assert any(not torch.allclose(want[key], v, rtol=1e-4, atol=1e-6) for key, v in simulate(union).items())


def test_checkpoint_round_trip_keeps_momentum_and_resets_errors(tmp_path: Any) -> None:
    """Saved after a compressed step, loaded by a fresh engine: Adam's state and step count come back; the
    per-rank error buffers start from zero (as DeepSpeed's 1-bit error buffers do on load)."""
    results = run_distributed(run, 2, True, WARM + 2, str(tmp_path), timeout=120)
    want = simulate(True, reset_at=WARM + 2)
    for r in results:
        for key, v in want.items():
            torch.testing.assert_close(r["state"][key], v, rtol=1e-6, atol=1e-7)


def test_momentum_exchange_refused_where_it_does_not_apply() -> None:
    from zerospeed.config import ConfigError, load_config
    from zerospeed.runtime.build_optimizer import topk as _topk

    p = [torch.nn.Parameter(torch.ones(2))]
    on = {"train_micro_batch_size_per_gpu": 1, "gradient_compression": COMPRESSION}
    for bad, match in (({"freeze_variance": False}, "needs freeze_variance"),
                       ({"momentum_exchange": False, "union_indices": True}, "needs momentum_exchange"),
                       ({"momentum_correction": True}, "cannot be combined with momentum_exchange"),
                       ({"error_feedback": False}, "needs error_feedback"),
                       ({"momentum_exchange": False, "local_variance": True}, "needs momentum_exchange")):
        with pytest.raises(ConfigError, match=match):
            _topk(load_config({**on, "gradient_compression": {**COMPRESSION, **bad}}), torch.optim.Adam(p))
    from zerospeed.zero.topk_momentum import momentum_exchange_for

    section = load_config(on).gradient_compression
    for fields, match in (({"partitioned": True}, "stage 0 only"), ({"clip": 1.0}, "gradient_clipping"),
                          ({"moe": True}, "Mixture-of-Experts")):
        args = {"partitioned": False, "clip": 0.0, "moe": False, **fields}
        with pytest.raises(ConfigError, match=match):
            momentum_exchange_for(section, dp_group=None, **args)
