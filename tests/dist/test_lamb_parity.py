"""Lamb under ZeRO 1-3 equals single-process Lamb: each trust ratio is the whole parameter's.

Each rank holds only a (zero-padded) shard of every parameter, so the norms ||w|| and ||update|| of the trust
ratio are summed over the shards in one all-reduce per step. The parity model has a frozen parameter, an unused
one of 3 elements (smaller than world 4: one rank owns only padding) and biases of 4 elements; global-norm
clipping and gradient accumulation are on. ``zero_allow_untested_optimizer`` is set so that shard-local norms
(the old behaviour, and DeepSpeed's on flat partitions) would run, and fail these comparisons.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.optim import Lamb
from zerospeed.testing import run_distributed

from .parity import global_batch, make_model, micro_batch, param_groups

STEPS, MB, GAS, CLIP = 6, 2, 2, 0.5
LAMB = {"lr": 2e-2, "betas": [0.9, 0.999], "eps": 1e-8, "max_coeff": 10.0, "min_coeff": 0.01}


def reference(world: int) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """One process, the whole global batch, zerospeed's Lamb, global-norm clipping."""
    model = make_model()
    opt = Lamb(param_groups(model), **{**LAMB, "betas": tuple(LAMB["betas"])})
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, MB * GAS * world)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # as under ZeRO: no gradient means a zero gradient
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, opt.get_lamb_coeffs()


def run(stage: int, offload: str = "none") -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
        "optimizer": {"type": "Lamb", "params": LAMB},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 300,
                              "offload_optimizer": {"device": offload}},
        "zero_allow_untested_optimizer": True, "steps_per_print": 1000,
    }
    engine, opt, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    lamb = opt.optimizer
    calls: list[int] = []
    reducer = getattr(lamb, "shard_norm_reducer", None)
    if reducer is not None:
        def counting(v: torch.Tensor) -> torch.Tensor:
            calls.append(v.numel())
            return reducer(v)
        lamb.shard_norm_reducer = counting
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        for m in range(GAS):
            x, y = micro_batch(step, m, rank, world, MB, GAS)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / GAS
        comm.all_reduce(total)
        losses.append(float(total) / world)
    n_tensors = sum(len(g["params"]) for g in lamb.param_groups)
    out = {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
           "coeffs": lamb.get_lamb_coeffs(), "calls": calls, "n_tensors": n_tensors}
    if opt.stepper is not None:
        opt.stepper.close()
    return out


def _check(results: list[dict[str, Any]], world: int) -> None:
    ref_losses, ref_state, ref_coeffs = reference(world)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6, msg=f"parameter {k}")
        # every rank reports the whole-parameter trust ratios of the last step
        torch.testing.assert_close(torch.tensor(r["coeffs"]), torch.tensor(ref_coeffs), rtol=1e-5, atol=0)
        # one collective per optimizer step, carrying (||w||^2, ||u||^2) of every tensor
        assert r["calls"] == [2 * r["n_tensors"]] * STEPS


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lamb_parity(stage: int, world: int) -> None:
    _check(run_distributed(run, world, stage, timeout=120), world)


@pytest.mark.parametrize("stage", [2, 3])
def test_lamb_parity_with_cpu_offload(stage: int) -> None:
    """Lamb has no flat kernel: under cpu offload it steps the host masters itself, norms summed the same way."""
    _check(run_distributed(run, 2, stage, "cpu", timeout=120), 2)


def test_lamb_without_untested_flag_is_accepted() -> None:
    """Lamb is exact under ZeRO now, so it needs no zero_allow_untested_optimizer."""
    from zerospeed.config import load_config
    from zerospeed.runtime.build_optimizer import check_zero_optimizer as _check_zero_optimizer

    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}})
    p = torch.nn.Parameter(torch.ones(2))
    _check_zero_optimizer(cfg, Lamb([p]))  # no ConfigError
    with pytest.raises(Exception, match="zero_allow_untested_optimizer"):
        _check_zero_optimizer(cfg, torch.optim.LBFGS([p]))
