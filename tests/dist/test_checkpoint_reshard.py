"""Reshard: save at world N / stage S, load at world M / stage S', and training continues as if uninterrupted.

The global batch is the same at every world size (gas = 4 / world), so the continued losses match the
uninterrupted run within fp32 tolerance (only the order of gradient sums differs), and the weights right
after loading equal the saved fp32 master weights exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .ckpt_common import build, full_state, train


def _save_run(stage: int, path: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    engine = build(stage)
    head = train(engine, 5)
    engine.save_checkpoint(path, tag="mid")
    saved = full_state(engine, fp32=True)
    return head + train(engine, 5), saved


def _load_run(stage: int, path: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    engine = build(stage, {"checkpoint": {"load_universal": True}})  # resharding needs it, as in DeepSpeed
    engine.load_checkpoint(path)
    loaded = full_state(engine, fp32=True)
    return train(engine, 5), loaded


CASES = [(2, 2, 1, 0), (2, 2, 4, 1), (4, 2, 2, 1), (2, 3, 1, 0), (2, 2, 4, 3), (4, 3, 2, 1)]


@pytest.mark.parametrize(("save_world", "save_stage", "load_world", "load_stage"), CASES)
def test_reshard(save_world: int, save_stage: int, load_world: int, load_stage: int, tmp_path: Any) -> None:
    (ref, saved), *_ = run_distributed(_save_run, save_world, save_stage, str(tmp_path), timeout=120)
    results = run_distributed(_load_run, load_world, load_stage, str(tmp_path), timeout=120)
    for tail, loaded in results:
        assert loaded.keys() == saved.keys()
        for k in saved:
            assert torch.equal(loaded[k], saved[k]), f"{k} differs right after loading"
        torch.testing.assert_close(torch.tensor(tail), torch.tensor(ref[5:]), rtol=1e-5, atol=1e-6)
