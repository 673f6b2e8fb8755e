"""Flops under ZeRO-3 (world 2): the same FLOPs and MACs as unsharded, and params at their full sizes.

Between uses a stage-3 parameter is an empty placeholder; DeepSpeed's profiler would count those (0). Ours
reads the full size from the shard state, so the figures equal the unsharded model's (DeepSpeed's fixture).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

import zerospeed
from tests.unit.flops_models import build, token_inputs
from zerospeed.profiling.flops_profiler import FlopsProfiler, number_to_string, params_to_string
from zerospeed.testing import run_distributed

FIXTURE = json.loads((Path(__file__).parents[1] / "unit" / "fixtures" / "deepspeed_flops.json").read_text())


def _run(out_dir: str) -> dict[str, Any]:
    model, _ = build("zerospeed_gpt")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "flops_profiler": {"enabled": True, "profile_step": 1, "detailed": False,
                           "output_file": os.path.join(out_dir, "profile.txt")},
    }
    engine, *_ = zerospeed.initialize(model=model, config=config)
    placeholders = sum(p.numel() == 0 for p in engine.module.parameters())
    (ids,) = token_inputs()
    prof = FlopsProfiler(engine.module)
    prof.start_profile()
    with torch.no_grad():
        engine.module(ids)
    prof.stop_profile()
    figures = [prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()]
    prof.end_profile()
    logits, _ = engine(ids)  # the engine's own profile of step 1 (rank 0 writes the file)
    engine.backward(logits.float().pow(2).mean())
    engine.step()
    return {"figures": figures, "placeholders": placeholders}


def test_flops_under_stage3(tmp_path: Any) -> None:
    expected = FIXTURE["cases"]["zerospeed_gpt"]["<root>"]
    results = run_distributed(_run, 2, str(tmp_path), timeout=120)
    for r in results:
        assert r["placeholders"] > 0, "the test must run on partitioned (placeholder) parameters"
        assert r["figures"] == expected
    text = (tmp_path / "profile.txt").read_text()
    flops, _, params = expected
    assert any(line.startswith("params per GPU:") and line.split()[-2:] == params_to_string(params).split()
               for line in text.splitlines()), text
    assert any(line.startswith("fwd flops per GPU:") and line.split()[-2:] == number_to_string(flops).split()
               for line in text.splitlines()), text
