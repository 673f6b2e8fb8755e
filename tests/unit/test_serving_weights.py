"""The weight-update plan of a serving engine, without processes: what does not fit is named before anything
changes (unknown, missing, shape, float into integer codes), a tied alias is loaded once, and the broadcast
buckets are runs of one dtype within the byte cap (a larger tensor alone)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.inference.serving_weights import buckets, copy_weights, fit_weights


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("codes", torch.zeros(2, dtype=torch.int8))


def test_fit_weights_names_what_does_not_fit_and_loads_a_tied_weight_once() -> None:
    m = _Tied()
    new = {"emb.weight": torch.ones(5, 3), "codes": torch.ones(2, dtype=torch.int8)}
    plan = fit_weights(m, new)
    assert len(plan) == 2  # emb.weight (head.weight is its alias) and codes
    copy_weights(m, plan)
    assert torch.equal(m.head.weight, torch.ones(5, 3)) and m.codes.tolist() == [1, 1]
    for bad, word in (({**new, "x": torch.ones(1)}, "unknown: ['x']"), ({"emb.weight": torch.ones(5, 3)}, "'codes'"),
                      ({**new, "emb.weight": torch.ones(3, 5)}, "(3, 5) != (5, 3)"),
                      ({**new, "codes": torch.ones(2)}, "torch.float32 into torch.int8")):
        with pytest.raises(ValueError, match="do not fit") as info:
            fit_weights(m, bad)
        assert word in str(info.value), str(info.value)
    assert torch.equal(m.emb.weight, torch.ones(5, 3))  # nothing changed


def test_buckets_are_runs_of_one_dtype_within_the_cap() -> None:
    ts = [torch.zeros(4), torch.zeros(4), torch.zeros(8), torch.zeros(2, dtype=torch.int8), torch.zeros(4)]
    targets = [(f"t{i}", t, None) for i, t in enumerate(ts)]
    assert buckets(targets, [0, 1, 2, 3, 4], cap=32) == [[0, 1], [2], [3], [4]]
    assert buckets(targets, [0, 1, 4], cap=1 << 20) == [[0, 1, 4]]
