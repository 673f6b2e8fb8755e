"""Search strategies over a list of experiments: grid (in order), random, and model-based (a least-squares
cost model over the experiments' numeric features picks the next most promising one). Each stops after
``num_trials`` experiments or ``early_stopping`` experiments in a row without a better metric."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

Measure = Callable[[dict[str, Any]], float | None]  # runs an experiment; its metric (higher is better) or None


def _features(exp: dict[str, Any]) -> list[float]:
    out: list[float] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key in sorted(node):
                walk(node[key])
        elif isinstance(node, bool):
            out.append(1.0 if node else 0.0)
        elif isinstance(node, (int, float)):
            out.append(float(node) if abs(node) < 1e4 else float(torch.tensor(float(node)).log10()))
    walk(exp)
    return out


class Tuner:
    def __init__(self, experiments: list[dict[str, Any]], num_trials: int, early_stopping: int, seed: int = 0) -> None:
        self.pending = list(experiments)
        self.num_trials, self.early_stopping = num_trials, early_stopping
        self.rng = random.Random(seed)
        self.results: list[tuple[dict[str, Any], float | None]] = []

    def next(self) -> dict[str, Any]:
        return self.pending.pop(0)

    def tune(self, measure: Measure) -> tuple[dict[str, Any] | None, float | None]:
        best, best_metric, since_best = None, None, 0
        while self.pending and len(self.results) < self.num_trials and since_best < self.early_stopping:
            exp = self.next()
            metric = measure(exp)
            self.results.append((exp, metric))
            if metric is not None and (best_metric is None or metric > best_metric):
                best, best_metric, since_best = exp, metric, 0
            else:
                since_best += 1
        return best, best_metric


class GridSearchTuner(Tuner):
    pass


class RandomTuner(Tuner):
    def next(self) -> dict[str, Any]:
        return self.pending.pop(self.rng.randrange(len(self.pending)))


class ModelBasedTuner(Tuner):
    """Random for the first few; then fits metric ~ features (least squares, failures as 0) and runs the
    pending experiment with the best prediction."""

    warmup = 3

    def next(self) -> dict[str, Any]:
        done = [(e, m) for e, m in self.results]
        if len(done) < self.warmup:
            return self.pending.pop(self.rng.randrange(len(self.pending)))
        x = torch.tensor([_features(e) + [1.0] for e, _ in done], dtype=torch.float64)
        y = torch.tensor([0.0 if m is None else m for _, m in done], dtype=torch.float64).unsqueeze(1)
        coef = torch.linalg.lstsq(x, y).solution
        cand = torch.tensor([_features(e) + [1.0] for e in self.pending], dtype=torch.float64)
        return self.pending.pop(int((cand @ coef).argmax()))


TUNERS: dict[str, type[Tuner]] = {"gridsearch": GridSearchTuner, "random": RandomTuner, "model_based": ModelBasedTuner}
