"""SuperOffload's config rules and its sink: which sub-group steps start during backward, and when."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zerospeed.config import ConfigError, load_config
from zerospeed.offload.subgroups import SubGroup
from zerospeed.offload.super_offload import SpeculativeGrads


def _zero(**offload: object) -> dict:
    return {"train_batch_size": 2, "zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "cpu", "super_offload": True, **offload}}}


def test_super_offload_config_rules() -> None:
    assert load_config(_zero()).zero_optimization.offload_optimizer.super_offload
    # (stage 3 only: a row of runtime/plan.py's RULES, tests/unit/test_train_plan.py)
    with pytest.raises(ConfigError, match="ratio"):
        load_config(_zero(ratio=0.5))
    with pytest.raises(ConfigError, match="device 'cpu'"):
        load_config(_zero(device="nvme", nvme_path="/tmp"))


def test_sink_starts_a_subgroup_when_complete_on_the_boundary_only() -> None:
    # one group of 10 elements: sub-group 0 = [0, 6) (pieces [0,4) and [5,6): element 4 is padding), 1 = [6, 10)
    sgs = [[SubGroup(0, 0, 0, 6, [(0, 4), (5, 6)]), SubGroup(0, 1, 6, 10, [(6, 10)])]]
    started: list[int] = []
    reads: list[int] = []
    sink = SpeculativeGrads(sgs, [10], lambda sg: started.append(sg.index), lambda: reads.append(1))
    reducer = SimpleNamespace(boundary=False)
    sink.follow(reducer)
    sink.add(0, 0, torch.ones(10))  # a micro-step that does not end the accumulation: nothing starts
    sink.end_micro_step()
    assert started == []
    reducer.boundary = True
    sink.add(0, 6, torch.ones(4))  # sub-group 1 is complete
    assert started == [1]
    sink.add(0, 0, torch.ones(4))  # 4 of sub-group 0's 5 elements
    assert started == [1]
    sink.add(0, 4, torch.ones(2))  # padding element 4 and element 5: complete
    assert started == [1, 0] and not sink.stale
    sink.add(0, 8, torch.ones(1))  # a late slice for a started sub-group voids its speculation
    assert sink.stale == {(0, 1)}
    assert torch.equal(sink.partition(0), torch.tensor([2.0] * 6 + [2, 2, 3, 2])) and reads == [1]
    sink.zero()
    assert not sink.launched and not sink.stale and float(sink.parts[0].sum()) == 0.0
