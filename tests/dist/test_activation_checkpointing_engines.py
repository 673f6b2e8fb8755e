"""Activation checkpointing belongs to its engine (issue 30 item 6): two engines in one process, each with
its own ``activation_checkpointing`` section, keep their own settings, timers and RNG tracker inside their
calls, while DeepSpeed's module-level ``deepspeed.checkpointing`` acts on the last one built."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import zerospeed
from zerospeed import checkpointing as ck
from zerospeed.testing import run_distributed


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.trackers: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.trackers.append(id(ck.get_cuda_rng_tracker()))
        return ck.checkpoint(lambda t: self.fc2(torch.relu(self.fc1(t))), x).pow(2).mean()


def _engine(section: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "activation_checkpointing": section}
    return zerospeed.initialize(model=Checkpointed(), config=config)[0]


def _two_engines() -> dict[str, Any]:
    profiled = _engine({"profile": True})
    plain = _engine({"profile": False})  # built last: the process default
    out: dict[str, Any] = {"default_is_last": ck.current() is plain.activation_checkpointing}
    for name, engine in (("profiled", profiled), ("plain", plain)):
        loss = engine(torch.randn(2, 8))
        engine.backward(loss)
        engine.step()
        own = engine.activation_checkpointing
        out[name] = {"timed": engine.timers.has(ck.FORWARD_TIMER), "profile": own.config.profile,
                     "own_tracker": set(engine.module.trackers) == {id(own.tracker)}}
    out["distinct"] = profiled.activation_checkpointing is not plain.activation_checkpointing
    return out


def test_two_engines_keep_their_own_activation_checkpointing() -> None:
    out = run_distributed(_two_engines, 1, timeout=120)[0]
    assert out["default_is_last"] and out["distinct"]
    assert out["profiled"] == {"timed": True, "profile": True, "own_tracker": True}
    assert out["plain"] == {"timed": False, "profile": False, "own_tracker": True}
