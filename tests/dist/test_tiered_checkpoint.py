"""``nebula`` / ``datastates_ckpt`` as zerospeed's tiered checkpointing (runtime/checkpoint/tiered.py): the save
returns after the host snapshot and commits in the background, Nebula keeps its retention count of
checkpoints, DataStates writes synchronously when the state outgrows its host cache; resuming is bitwise."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import zerospeed
from zerospeed.testing import run_distributed


def _engine(extra: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 1}, **extra}
    return zerospeed.initialize(model=model, config=config)[0]


def _step(engine: Any, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    loss = engine(torch.randn(2, 16, generator=g)).pow(2).mean()
    engine.backward(loss)
    engine.step()


def _run(path: str) -> dict[str, Any]:
    engine = _engine({"nebula": {"enabled": True, "num_of_version_in_retention": 2}})
    background = []
    for i in range(3):
        _step(engine, i)
        engine.save_checkpoint(path, tag=f"v{i}")
        background.append(not engine.last_checkpoint_stats.done)  # returned after the snapshot
        engine.wait_for_checkpoint()
    kept = sorted(e for e in os.listdir(path) if not e.startswith(".") and e != "latest")
    want = [p.detach().clone() for p in engine.module.parameters()]
    fresh = _engine({"nebula": {"enabled": True}})
    fresh.load_checkpoint(path)
    same = all(torch.equal(a, b) for a, b in zip(want, fresh.module.parameters()))
    small = _engine({"datastates_ckpt": {"host_cache_size": 1e-9}})  # 1 byte: over the cache
    big = _engine({"datastates_ckpt": {"host_cache_size": 16}})
    done = []
    for eng, tag in ((small, "small"), (big, "big")):
        _step(eng, 0)
        eng.save_checkpoint(path + "_ds", tag=tag)
        done.append(eng.last_checkpoint_stats.done)
        eng.wait_for_checkpoint()
    return {"background": background, "kept": kept, "same": same, "done": done}


def test_nebula_and_datastates_are_tiered_background_saves(tmp_path) -> None:
    out = run_distributed(_run, 1, str(tmp_path / "ck"), timeout=120)[0]
    assert out["background"] == [True, True, True]
    assert out["kept"] == ["v1", "v2"]  # num_of_version_in_retention: 2
    assert out["same"]
    assert out["done"] == [True, False]  # over the host cache: written synchronously; within it: in the background
