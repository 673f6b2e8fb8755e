"""``zero_local_grad_accumulation``: stage 2 accumulates micro-steps locally and reduce-scatters once per boundary.

Same math as one process (rtol 1e-5, with clipping), fewer bytes on the wire than stage 2's per-micro-step
reduce-scatter, and checkpoints: refused mid-accumulation, bitwise resume from a boundary.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .ckpt_common import build, train
from .parity import engine_losses, reference_losses

STEPS, MB, CLIP = 6, 2, 0.5
LOCAL = {"zero_local_grad_accumulation": True}


def _volumes(gas: int) -> dict[str, Any]:
    """Comm volume of one step and the reducer's mode, without and with local accumulation."""
    out: dict[str, Any] = {}
    for name, extra in (("default", {}), ("local", LOCAL)):
        engine = build(2, {"gradient_accumulation_steps": gas, **extra})
        train(engine, 2)
        out[name] = (engine.last_step_comm_volume, engine.optimizer.reducer.store.accumulates_locally)
    return out


@pytest.mark.parametrize("gas", [2, 3])
def test_parity_with_clipping(gas: int) -> None:
    ref_losses, ref_state = reference_losses(STEPS, MB, gas, 2, CLIP)
    for losses, state in run_distributed(engine_losses, 2, 2, STEPS, MB, gas, CLIP, 1e-2, LOCAL, timeout=120):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=f"parameter {k}")


def test_reduces_once_per_boundary() -> None:
    """GAS 3: the local mode moves less than the default's (gas+1)Ψ; GAS 1 never makes the full buffer."""
    for out in run_distributed(_volumes, 2, 3, timeout=120):
        (vol_default, local_default), (vol_local, local_local) = out["default"], out["local"]
        assert not local_default and local_local
        assert vol_local < 0.8 * vol_default, (vol_local, vol_default)
    for out in run_distributed(_volumes, 2, 1, timeout=120):
        assert not out["local"][1] and out["local"][0] == out["default"][0]


def _save_mid_then_boundary(path: str) -> list[float]:
    from zerospeed.runtime.checkpoint import CheckpointError
    from .parity import micro_batch

    engine = build(2, LOCAL)
    losses = train(engine, 3)
    x, y = micro_batch(engine.global_steps, 0, engine.global_rank, 2, 2, engine.gradient_accumulation_steps())
    engine.backward(engine(x, y))
    engine.step()  # half an accumulation: gradients in the local buffer only
    with pytest.raises(CheckpointError, match="middle of a gradient accumulation"):
        engine.save_checkpoint(path)
    return losses


def _straight(path: str) -> list[float]:
    engine = build(2, LOCAL)
    first = train(engine, 3)
    engine.save_checkpoint(path)
    return first + train(engine, 3)


def _resumed(path: str) -> list[float]:
    engine = build(2, LOCAL)
    engine.load_checkpoint(path)
    assert engine.global_steps == 3
    return train(engine, 3)


def test_checkpoint_rules(tmp_path: Any) -> None:
    run_distributed(_save_mid_then_boundary, 2, str(tmp_path / "mid"), timeout=120)
    straight = run_distributed(_straight, 2, str(tmp_path / "ok"), timeout=120)
    resumed = run_distributed(_resumed, 2, str(tmp_path / "ok"), timeout=120)
    for full, tail in zip(straight, resumed):
        assert full[3:] == tail, f"resumed losses differ:\n{tail}\n{full[3:]}"
