"""Two engines in the GAN pattern: the generator's backward also reaches the discriminator's weights. Those
gradients arrive outside the discriminator engine's own backward(): they stay in ``p.grad`` (cleared by
the user's ``zero_grad()``), as in plain PyTorch, instead of being applied at its next step. Stage 3, which
cannot keep them beside partitioned weights, says so."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from zerospeed.testing import run_distributed

ITERS, BATCH, LR = 4, 8, 5e-2


def _nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
    disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    return gen, disc


def _batch(it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + it)
    return torch.randn(BATCH, 6, generator=g) * 0.5 + 1.0, torch.randn(BATCH, 4, generator=g)


def _bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def _reference() -> list[tuple[float, float]]:
    gen, disc = _nets()
    opt_g = torch.optim.Adam(gen.parameters(), lr=LR)
    opt_d = torch.optim.Adam(disc.parameters(), lr=LR)
    out = []
    for it in range(ITERS):
        real, z = _batch(it)
        opt_d.zero_grad()
        d_loss = _bce(disc(real), 1.0) + _bce(disc(gen(z).detach()), 0.0)
        d_loss.backward()
        opt_d.step()
        opt_g.zero_grad()
        g_loss = _bce(disc(gen(z)), 1.0)
        g_loss.backward()  # also fills disc's p.grad: cleared by opt_d.zero_grad() next iteration
        opt_g.step()
        out.append((d_loss.item(), g_loss.item()))
    return out


def _gan(stage: int, clear: str = "module") -> Any:
    import zerospeed
    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    gen, disc = _nets()

    def config() -> dict[str, Any]:
        return {"train_micro_batch_size_per_gpu": BATCH // world,
                "optimizer": {"type": "Adam", "params": {"lr": LR}},
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}

    g_engine, *_ = zerospeed.initialize(model=gen, model_parameters=gen.parameters(), config=config())
    d_engine, *_ = zerospeed.initialize(model=disc, model_parameters=disc.parameters(), config=config())
    out = []
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    try:
        for it in range(ITERS):
            real, z = (t[lo:hi] for t in _batch(it))
            d_engine.zero_grad() if clear == "engine" else disc.zero_grad()  # as the user clears p.grad
            d_loss = _bce(d_engine(real), 1.0) + _bce(d_engine(g_engine(z).detach()), 0.0)
            d_engine.backward(d_loss)
            d_engine.step()
            g_engine.zero_grad() if clear == "engine" else gen.zero_grad()
            g_loss = _bce(d_engine(g_engine(z)), 1.0)
            g_engine.backward(g_loss)
            g_engine.step()
            losses = torch.stack([d_loss.detach(), g_loss.detach()])
            comm.all_reduce(losses)
            out.append(tuple((losses / world).tolist()))
    except RuntimeError as exc:
        return str(exc)
    return out


@pytest.mark.parametrize("clear", ["module", "engine"])
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gan_losses_match_plain_pytorch(stage: int, world: int, clear: str) -> None:
    ref = torch.tensor(_reference())
    for losses in run_distributed(_gan, world, stage, clear, timeout=60):
        torch.testing.assert_close(torch.tensor(losses), ref, rtol=1e-5, atol=1e-6)


def test_stage3_refuses_gradients_from_another_engine() -> None:
    for message in run_distributed(_gan, 2, 3, timeout=60):
        assert isinstance(message, str) and "outside this engine's backward" in message, message
        assert "stage 3" in message


def _volumes() -> dict[str, Any]:
    """Two engines stepping in turns: each one's per-step comms volume and summary count only its own."""
    import zerospeed

    torch.manual_seed(0)
    big, small = nn.Linear(64, 64), nn.Linear(4, 2)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 0}}
    eng_big, *_ = zerospeed.initialize(model=big, config=cfg)
    eng_small, *_ = zerospeed.initialize(model=small, config=cfg)
    out: dict[str, Any] = {"big": [], "small": []}
    for _ in range(3):
        for name, eng, width in (("big", eng_big, 64), ("small", eng_small, 4)):
            eng.backward(eng(torch.randn(2, width)).square().mean())
            eng.step()
            out[name].append(eng.last_step_comm_volume)
    out["small_summary"] = eng_small.comms_summary()
    return out


def test_two_engines_have_separate_comms_volumes() -> None:
    r = run_distributed(_volumes, 2, timeout=90)[0]
    small_grad = (4 * 2 + 2) * 4  # fp32 bytes of the small model's gradient
    big_grad = (64 * 64 + 64) * 4
    # stage 0: one all-reduce of the gradient (volume 2x the message) and the grad-norm scalars, nothing else:
    # the other engine's all-reduces, issued between this engine's steps, are not in its count
    assert all(2 * small_grad <= v < 2 * small_grad + 64 for v in r["small"]), r["small"]
    assert all(2 * big_grad <= v < 2 * big_grad + 64 for v in r["big"]), r["big"]
    mb = float(r["small_summary"].splitlines()[1].split()[3])  # all_reduce volume MB over the three steps
    assert mb < 0.01, r["small_summary"]
