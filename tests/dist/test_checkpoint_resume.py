"""Resume: 10 steps straight == 5 steps, save, load in a fresh process group, 5 steps (bitwise on CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .ckpt_common import build, full_state, train

PRECISIONS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3}},
}


def _first_half(stage: int, extra: dict[str, Any], path: str) -> tuple[list[float], dict[str, Any]]:
    """10 steps straight, saving after step 5 (which must not disturb the run)."""
    engine = build(stage, extra)
    ref = train(engine, 5)
    engine.save_checkpoint(path, client_state={"note": "half", "t": torch.arange(3)})
    scaler = engine.optimizer.loss_scaler.state_dict()
    return ref + train(engine, 5), scaler


def _second_half(stage: int, extra: dict[str, Any], path: str) -> tuple[list[float], dict[str, Any], Any, Any]:
    engine = build(stage, extra)
    loaded, client = engine.load_checkpoint(path)
    assert loaded is not None and engine.global_steps == 5
    scaler = engine.optimizer.loss_scaler.state_dict()
    rest = train(engine, 5)
    return rest, scaler, client, full_state(engine)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_is_bitwise(stage: int, precision: str, tmp_path: Any) -> None:
    extra = PRECISIONS[precision]
    world = 2
    first = run_distributed(_first_half, world, stage, extra, str(tmp_path), timeout=120)
    second = run_distributed(_second_half, world, stage, extra, str(tmp_path), timeout=120)
    for (ref, scaler_saved), (tail, scaler_loaded, client, _) in zip(first, second):
        assert ref[:5] + tail == ref, f"resumed losses differ:\n{tail}\n{ref[5:]}"
        assert scaler_loaded == scaler_saved
        assert client["note"] == "half" and torch.equal(client["t"], torch.arange(3))
