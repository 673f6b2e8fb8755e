"""Config fuzz (issue 31, acceptance): every example config in the repository, mutated (wrong types, inf,
NaN, 0, negative, huge, unknown keys, typos), is either refused with a ``ConfigError`` naming a key, or trains
2 steps with finite parameters and no skipped steps. Seeded; bounded to ``BUDGET_S`` seconds (one rank of the
harness, a tiny model)."""

from __future__ import annotations

import copy
import json
import math
import random
import re
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerospeed.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
SEED = 31
BUDGET_S = 12.0
KEEP = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"}


def example_configs() -> dict[str, dict]:
    """``examples/**/*.json`` and the JSON config blocks of README.md and docs/*.md."""
    out: dict[str, dict] = {}
    for path in sorted((ROOT / "examples").rglob("*.json")):
        out[str(path.relative_to(ROOT))] = json.loads(path.read_text())
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, block in enumerate(re.findall(r"```json\n(.*?)```", md.read_text(), re.S)):
            try:
                cfg = json.loads(block)
            except ValueError:
                continue
            if isinstance(cfg, dict) and ("optimizer" in cfg or "train_micro_batch_size_per_gpu" in cfg):
                out[f"{md.relative_to(ROOT)}#{i}"] = cfg
    return out


def _leaves(obj: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(obj, dict):
        return [path] + [p for k, v in obj.items() for p in _leaves(v, path + (k,))]
    return [path]


def _typo(key: str, rng: random.Random) -> str:
    if len(key) < 3:
        return key + "x"
    i = rng.randrange(len(key) - 1)
    return key[:i] + key[i + 1] + key[i] + key[i + 2:] if key[i] != key[i + 1] else key + "s"


MUTATIONS = ["string", "list", "inf", "-inf", "nan", "zero", "negative", "huge", "unknown", "typo", "null"]


def mutate(cfg: dict, rng: random.Random) -> tuple[dict, str]:
    cfg = copy.deepcopy(cfg)
    path = rng.choice([p for p in _leaves(cfg) if p])
    kind = rng.choice(MUTATIONS)
    parent = cfg
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    value = parent[key]
    new: Any = {"string": "x", "list": [1, 2], "inf": math.inf, "-inf": -math.inf, "nan": math.nan, "zero": 0,
                "null": None, "huge": 1e30,
                "negative": -abs(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value
                else -1}.get(kind)
    if kind == "unknown":
        target = value if isinstance(value, dict) else parent
        target["zz_unknown_key"] = 1
    elif kind == "typo":
        parent[_typo(key, rng)] = parent.pop(key)
    else:
        parent[key] = new
    return cfg, f"{'.'.join(map(str, path))} <- {kind}"


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.fc2(torch.tanh(self.fc1(x))).float() - y.float()) ** 2).mean()


def _attempt(cfg: dict) -> str:
    """'config error: KEY' or 'trained'; anything else raises (the test fails with the mutation named)."""
    import zerospeed
    from zerospeed.config import ConfigError

    model = Tiny()
    try:
        engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except ConfigError as exc:
        assert exc.key or "config key" in str(exc), f"ConfigError without a key: {exc}"
        return f"config error: {exc.key}"
    try:
        g = torch.Generator().manual_seed(0)
        for _ in range(2 * engine.gradient_accumulation_steps()):
            mb = engine.train_micro_batch_size_per_gpu()
            x, y = torch.randn(mb, 8, generator=g), torch.randn(mb, 1, generator=g)
            loss = engine(x.to(engine.compute_dtype), y.to(engine.compute_dtype))
            engine.backward(loss)
            engine.step()
        assert engine.skipped_steps == 0, f"{engine.skipped_steps} skipped steps"
        for name, p in engine.module.named_parameters():
            assert torch.isfinite(p.detach().float()).all(), f"parameter {name} is not finite"
    finally:
        engine.destroy()
    return "trained"


def _fuzz(configs: dict[str, dict], budget_s: float) -> dict[str, int]:
    rng = random.Random(SEED)
    deadline = time.monotonic() + budget_s
    outcomes: dict[str, int] = {}
    names = sorted(configs)
    while time.monotonic() < deadline:
        name = rng.choice(names)
        base = copy.deepcopy(configs[name])
        base["steps_per_print"] = 10**9
        cfg, what = mutate(base, rng)
        try:
            result = _attempt(cfg)
        except Exception as exc:  # noqa: BLE001 - reported with the mutation that caused it
            raise AssertionError(f"{name}: {what}: neither a ConfigError naming a key nor 2 clean steps: "
                                 f"{type(exc).__name__}: {exc}") from exc
        outcomes[result.split(":")[0]] = outcomes.get(result.split(":")[0], 0) + 1
    return outcomes


def test_mutated_example_configs_are_refused_by_key_or_train_cleanly() -> None:
    configs = example_configs()
    assert len(configs) >= 2
    (outcomes,) = run_distributed(_fuzz, 1, configs, BUDGET_S, timeout=BUDGET_S + 60)
    assert outcomes.get("config error", 0) > 0 and outcomes.get("trained", 0) > 0, outcomes
