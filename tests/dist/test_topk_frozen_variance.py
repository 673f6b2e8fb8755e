"""``gradient_compression`` with ``warmup_steps`` and ``freeze_variance`` through the engine at world 2 equals a
one-process simulation of the same algorithm: dense AdamW for the warm-up, then top-k of the error-compensated
gradients ranked by ``|acc| / (sqrt(v_hat) + eps)`` with Adam's variance frozen; bytes counted by the comms logger."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.comm.sparse import topk_count
from zerospeed.testing import run_distributed

from .test_onebit_adam import Wide

WARM, STEPS, RATIO, LR, WD, BETAS, EPS = 3, 7, 0.05, 3e-3, 0.01, (0.9, 0.999), 1e-8
COMPRESSION = {"type": "topk", "ratio": RATIO, "warmup_steps": WARM, "freeze_variance": True}


def data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + rank))


def run(stage: int, momentum: bool, pre: bool) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm

    rank = comm.get_rank()
    model = Wide()
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 10**6},
              "gradient_compression": {**COMPRESSION, "momentum_correction": momentum, "preconditioned_selection": pre}}
    engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    per_step = []
    for step in range(STEPS):
        before = comm.COMMS_LOGGER.snapshot()
        loss = engine(data(step, rank))
        engine.backward(loss)
        engine.step()
        after = comm.COMMS_LOGGER.snapshot()
        per_step.append({op: after[op].bytes - (before[op].bytes if op in before else 0) for op in after})
    return {"per_step": per_step, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def simulate(momentum: bool, pre: bool) -> dict[str, torch.Tensor]:
    """The same algorithm in one process: two ranks' gradients from the same replica. ``momentum``: DGC's
    momentum correction (each rank's own momentum u is accumulated and sent; sent entries leave u)."""
    model = Wide()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, betas=BETAS, eps=EPS)
    n = sum(p.numel() for p in params)
    k = topk_count(n, RATIO)
    residual = [torch.zeros(n), torch.zeros(n)]
    velocity = [torch.zeros(n), torch.zeros(n)]
    precond = None
    for step in range(STEPS):
        grads = []
        for rank in range(2):
            model.zero_grad()
            model(data(step, rank)).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        if step < WARM:
            avg = (grads[0] + grads[1]) * 0.5
        else:
            if precond is None:
                v = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in params])
                precond = 1.0 / ((v / (1 - BETAS[1] ** WARM)).sqrt() + EPS)
            total = torch.zeros(n)
            for rank in range(2):
                if momentum:
                    grads[rank] = velocity[rank].mul_(BETAS[0]).add_(grads[rank], alpha=1 - BETAS[0]).clone()
                acc = residual[rank].add_(grads[rank])
                idx = torch.topk(acc.abs() * precond if pre else acc.abs(), k, sorted=False).indices
                total.index_add_(0, idx, acc[idx])
                acc[idx] = 0.0
                velocity[rank][idx] = 0.0
            avg = total * 0.5
        at = 0
        for p in params:
            p.grad = avg[at: at + p.numel()].view_as(p).clone()
            at += p.numel()
        if step < WARM:
            opt.step()
            continue
        with torch.no_grad():  # AdamW with exp_avg_sq and its bias correction frozen at step WARM
            for p in params:
                st = opt.state[p]
                st["step"] += 1
                p.mul_(1 - LR * WD)
                if momentum:  # the exchanged momentum is the momentum (1-bit Adam's rule), no bias correction
                    st["exp_avg"].copy_(p.grad)
                else:
                    st["exp_avg"].lerp_(p.grad, 1 - BETAS[0])
                denom = (st["exp_avg_sq"].sqrt() / (1 - BETAS[1] ** WARM) ** 0.5).add_(EPS)
                step_size = LR if momentum else LR / (1 - BETAS[0] ** float(st["step"]))
                p.addcdiv_(st["exp_avg"], denom, value=-step_size)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage,momentum,pre", [(0, False, True), (1, False, False), (0, True, False),
                                                (1, True, True)])
def test_frozen_variance_topk_equals_simulation(stage: int, momentum: bool, pre: bool) -> None:
    results = run_distributed(run, 2, stage, momentum, pre, timeout=120)
    want = simulate(momentum, pre)
    for r in results:
        for key, v in want.items():
            torch.testing.assert_close(r["state"][key], v, rtol=1e-6, atol=1e-7)
    n, k = 4096, topk_count(4096, RATIO)
    steps = results[0]["per_step"]
    for s in steps[:WARM]:  # dense warm-up: the gradient all-reduce (stage 1: reduce-scatter)
        assert s.get("all_reduce", 0) + s.get("reduce_scatter", 0) >= 4 * n // 2
    for t, s in enumerate(steps[WARM:], WARM):
        assert s.get("all_reduce", 0) <= 8 and s.get("reduce_scatter", 0) == 0
        sparse = 2 * 2 * k * 4  # indices + values from both ranks
        rebuild = 4 * n if stage == 1 else 0  # stage 1 all-gathers the updated fp32 shards every step
        assert s["all_gather"] == sparse + rebuild, (t, s)


def test_freeze_variance_refused_where_it_does_not_apply() -> None:
    from zerospeed.config import ConfigError, load_config
    from zerospeed.runtime.build_optimizer import topk as _topk

    p = [torch.nn.Parameter(torch.ones(2))]
    on = {"train_micro_batch_size_per_gpu": 1, "gradient_compression": COMPRESSION}
    assert _topk(load_config(on), torch.optim.Adam(p)) == {"topk_ratio": RATIO, "topk_error_feedback": True,
                                                            "topk_warmup_steps": WARM, "topk_freeze_variance": True,
                                                            "topk_momentum_correction": False,
                                                            "topk_preconditioned_selection": False}
    with pytest.raises(ConfigError, match="Adam or AdamW"):
        _topk(load_config(on), torch.optim.SGD(p, lr=0.1))
    with pytest.raises(ConfigError, match="needs freeze_variance"):
        _topk(load_config({**on, "gradient_compression": {**COMPRESSION, "freeze_variance": False,
                                                          "momentum_correction": True}}), torch.optim.Adam(p))
    with pytest.raises(ConfigError, match="warmup_steps"):
        _topk(load_config({**on, "gradient_compression": {**COMPRESSION, "warmup_steps": 0}}), torch.optim.Adam(p))
