"""Stage 3 measured by the library: model-state bytes per rank and communication volume per step.

Psi = number of model parameters (all cut: persistence threshold 0, sizes divisible by N, so there is
no padding). Mixed precision, per rank: 16-bit shard 2Psi/N + gradient partition + fp32 master 4Psi/N +
Adam moments 8Psi/N. With fp16 the gradient partition is fp16 (2Psi/N): 16Psi/N in all. With bf16 our
gradient partition is accumulated in fp32 (4Psi/N, precision.policy): 18Psi/N.
Communication per step (GAS 1): all-gather Psi (forward) + all-gather Psi (backward) + reduce-scatter
Psi, in the ZeRO convention (comm/logger.py), times the bytes per element of the 16-bit dtype; this
needs ``stage3_max_reuse_distance: 0`` (with DeepSpeed's default, 1e9, a model this small keeps its
parameters gathered from forward to backward after the first step, so backward gathers nothing).
"""

import pytest
import torch
from torch import nn

from zerospeed.testing import run_distributed

WIDTH = 32


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH))


def _data_volume() -> int:
    """Volume of the data collectives (not the few-byte gather fingerprints, zero/stage3/lockstep.py)."""
    from zerospeed import comm

    return sum(st.volume for op, st in comm.COMMS_LOGGER.stats.items() if op != "exchange_ints")


def _measure(precision: str) -> dict:
    import zerospeed
    from zerospeed import comm

    model = _model()
    psi = sum(p.numel() for p in model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "reduce_bucket_size": 5000, "stage3_prefetch_bucket_size": 5000,
                                 "stage3_max_reuse_distance": 0},
           precision: {"enabled": True, **({"initial_scale_power": 4} if precision == "fp16" else {})},
           "communication_data_type": "fp16" if precision == "fp16" else "bf16"}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    volumes = []
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2, WIDTH, generator=g).to(engine.compute_dtype)
        start = _data_volume()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        volumes.append(_data_volume() - start)
        assert engine.was_step_applied()
    return {"psi": psi, "memory": engine.memory_breakdown(), "volumes": volumes, "world": comm.get_world_size()}


@pytest.mark.parametrize("precision,bytes_per_param,world", [("fp16", 16, 2), ("fp16", 16, 4), ("bf16", 18, 2)])
def test_model_state_bytes_and_volume(world: int, precision: str, bytes_per_param: int) -> None:
    for r in run_distributed(_measure, world, precision, timeout=120):
        psi = r["psi"]
        assert r["memory"]["model_states"] <= 1.05 * bytes_per_param * psi / world, r["memory"]
        assert r["memory"]["params"] == 2 * psi // world
        for v in r["volumes"]:
            assert 3 * 2 * psi <= v <= 1.05 * 3 * 2 * psi, (v, 6 * psi)


def _fp32_stage3_state() -> tuple[int, int]:
    import zerospeed
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    engine, *_ = zerospeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 64)).pow(2).mean())
        engine.step()
    return engine.memory_breakdown()["model_states"], sum(s.numel for s in engine.zero3.shards)


def test_fp32_stage3_holds_16_psi_over_n() -> None:
    """fp32: the parameter shard is the master slot (no second copy): 4 + 8 (Adam) + 4 (grad) bytes / N."""
    for world in (2, 4):
        for measured, psi in run_distributed(_fp32_stage3_state, world):
            assert 16 * psi / world <= measured <= 1.05 * 16 * psi / world, (measured, psi, world)
