"""Model-state bytes per rank and bytes communicated per step, counted by the library, vs the ZeRO formulas.

Mixed precision (fp16 params/grads, fp32 master + Adam moments), Psi trainable parameters, N ranks:
stage 0 = 16 Psi, stage 1 = 4 Psi + 12 Psi / N, stage 2 = 2 Psi + 14 Psi / N; communication = 2 Psi
elements per step (all-reduce = reduce-scatter + all-gather).
"""

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed import comm
from zerospeed.testing import run_distributed


def formula(stage: int, psi: int, n: int) -> float:
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n}[stage]


def _measure(stage: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    config = {"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True, "loss_scale": 128},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000}}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    out = {}
    for step in range(2):
        x = torch.randn(4, 64).half()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        before = comm.COMMS_LOGGER.snapshot()
        engine.step()
        out["volume"] = engine.last_step_comm_volume
    out["memory"] = engine.memory_breakdown()
    out["psi"] = sum(p.numel() for p in model.parameters())
    out["ops"] = sorted(before)
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_model_state_bytes_and_volume(stage: int, world: int) -> None:
    for r in run_distributed(_measure, world, stage, timeout=120):
        psi = r["psi"]
        expected = formula(stage, psi, world)
        measured = r["memory"]["model_states"]
        assert expected * 0.99 <= measured <= 1.05 * expected, (measured, expected, r["memory"])
        # fp16 communication: 2 bytes per element, 2 Psi elements per step
        assert 2 * psi * 2 * 0.99 <= r["volume"] <= 1.05 * 2 * psi * 2, (r["volume"], 4 * psi)


def _logged_bytes() -> dict:
    comm.COMMS_LOGGER.reset()
    t = torch.ones(1000)
    comm.all_reduce(t)
    out = torch.empty(500)
    comm.reduce_scatter(out, t)
    gathered = torch.empty(2000)
    comm.all_gather(gathered, t)
    snap = comm.COMMS_LOGGER.snapshot()
    return {k: (v.count, v.bytes, v.volume) for k, v in snap.items()}


def test_comms_logger_counts_tensor_sizes() -> None:
    for r in run_distributed(_logged_bytes, 2):
        assert r["all_reduce"] == (1, 4000, 8000)
        assert r["reduce_scatter"] == (1, 4000, 4000)
        assert r["all_gather"] == (1, 8000, 8000)
