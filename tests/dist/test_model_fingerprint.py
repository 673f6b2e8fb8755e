"""Ranks that built different models fail ``initialize()`` on every rank, naming the first differing
parameter, instead of aborting in Gloo's native code or training half-synchronised (issue 31, item 11)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.testing import run_distributed

CFG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
       "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}


def _init(kind: str) -> str:
    import zerospeed
    from zerospeed import comm
    from zerospeed.runtime.lockstep import ModelMismatchError

    odd = comm.get_rank() == 1
    width = 6 if odd and kind == "width" else 4
    layers = [nn.Linear(4, width), nn.Linear(width, 2)]
    if odd and kind == "deeper":
        layers.append(nn.Linear(2, 2))
    model = nn.Sequential(*layers)
    try:
        engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=CFG)
    except ModelMismatchError as exc:
        return str(exc)
    engine.destroy()
    return "built"


@pytest.mark.parametrize("kind, pattern", [("width", r"'0.weight' shape \[4, 4\] .* on rank 0, '0.weight' shape "
                                                      r"\[6, 4\] .* on rank 1"),
                                           ("deeper", r"rank 0 has 4 parameters, rank 1 6; the first extra one is "
                                                      r"'2.weight'"),
                                           ("same", r"built")])
def test_different_models_fail_on_every_rank(kind: str, pattern: str) -> None:
    got = run_distributed(_init, 2, kind, timeout=60)
    assert got[0] == got[1], got
    import re

    assert re.search(pattern, got[0]), got[0]
