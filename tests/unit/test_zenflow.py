"""ZenFlow's pure parts: config keys and their effect on the schedule, column selection on a rank's partition,
DeepSpeed's ``auto`` update rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.config import ConfigError, load_config
from zerospeed.config.zenflow import ZenFlowConfig
from zerospeed.offload.zenflow.schedule import AutoInterval, Schedule
from zerospeed.offload.zenflow.select import (column_sums, layout_of, matrix_sums, num_selected, selected_elements,
                                              top_columns)
from zerospeed.zero import ShardedGroup


def zen(**kw: object) -> ZenFlowConfig:
    cfg = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": kw}}, 2)
    assert cfg.zero_optimization.zenflow is not None
    return cfg.zero_optimization.zenflow


def test_defaults_are_deepspeeds() -> None:
    z = zen()
    assert (z.topk_ratio, z.select_strategy, z.select_interval, z.update_interval, z.overlap_step, z.offload,
            z.auto_ratio, z.full_warm_up_rounds, z.steps_per_epoch) == (0.1, "auto", "auto", "auto", False, False,
                                                                         0.99, 0, None)
    assert load_config({"train_batch_size": 8}, 2).zero_optimization.zenflow is None


def test_select_interval_resolution() -> None:
    assert zen(select_strategy="step", select_interval=5).resolved_select_interval() == 5
    assert zen(select_strategy="epoch", select_interval=2, steps_per_epoch=7).resolved_select_interval() == 14
    assert zen(select_strategy="epoch", select_interval=2).resolved_select_interval() == 0  # epoch length unknown
    assert zen(select_strategy="epoch", select_interval=2).resolved_select_interval(10) == 20  # from the loader
    assert zen().resolved_select_interval(9) == 9  # auto: every epoch
    assert zen(steps_per_epoch=4).resolved_select_interval() == 4


@pytest.mark.parametrize("bad,msg", [
    ({"select_interval": 3}, "select_strategy 'auto'"),
    ({"select_strategy": "step"}, "needs a number"),
    ({"select_strategy": "step", "select_interval": 2, "update_interval": 4}, "must be >= update_interval"),
    ({"update_interval": 0}, "at least 1"),
    ({"topk_ratio": 1.0}, "topk_ratio"),
    ({"select_strategy": "random"}, "select_strategy"),
    ({"auto_ratio": 1.5}, "auto_ratio"),
    ({"topk_ratios": 0.1}, "Did you mean .topk_ratio"),
])
def test_bad_keys(bad: dict[str, object], msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        zen(**bad)


def test_refused_combinations() -> None:
    with pytest.raises(ConfigError, match="zenflow needs offload_optimizer.device 'cpu'"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "zenflow": {}}}, 2)
    with pytest.raises(ConfigError, match="ratio < 1.*not supported yet"):
        load_config({"train_batch_size": 8, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}, "zenflow": {}}}, 2)
    with pytest.raises(ConfigError, match="pt_reserved_cores_perc"):  # a share of the cores: in (0, 1)
        zen(pt_reserved_cores_perc=1.5)
    assert zen(pt_reserved_cores_perc=0.25).pt_reserved_cores_perc == 0.25  # read (offload/cores.py)
    assert zen(pt_reserved_cores_perc=0.5).topk_ratio == 0.1  # DeepSpeed's default


def test_schedule_fixed_intervals() -> None:
    s = Schedule(warm_up=2, select_interval=6, update_interval=2)
    assert [t for t in range(14) if s.in_warm_up(t)] == [0, 1]
    assert [t for t in range(14) if s.selects(t)] == [2, 6, 12]
    assert [t for t in range(2, 14) if s.fixed_update(t)] == [3, 5, 7, 9, 11, 13]
    once = Schedule(warm_up=0, select_interval=0, update_interval=3)
    assert [t for t in range(9) if once.selects(t)] == [0]
    assert [t for t in range(9) if once.fixed_update(t)] == [2, 5, 8]
    odd = Schedule(warm_up=0, select_interval=5, update_interval=3)  # an update also just before each reselection
    assert [t for t in range(10) if odd.fixed_update(t)] == [2, 4, 5, 8, 9]


def test_auto_rule_is_deepspeeds_formula() -> None:
    k, ratio = 0.25, 1.0
    rule = AutoInterval(k, ratio)
    total = [torch.tensor([10.0, 10.0]), torch.tensor([10.0, 10.0]), torch.tensor([10.0, 10.0])]
    critical = [torch.tensor([6.0, 2.0]), torch.tensor([6.0, 2.0]), torch.tensor([6.0, 2.0])]
    avg, rest, dues = torch.zeros(2), torch.zeros(2), []
    for u, (tot, crit) in enumerate(zip(total, critical), start=1):
        avg = (avg * (u - 1) + crit) / u / (k * 10)
        rest = rest + (tot - crit) / ((1 - k) * 10)
        dues.append(int((rest >= avg).sum()) >= int(ratio * 2))
        assert rule.observe(tot, crit) == dues[-1]
        torch.testing.assert_close(rule.avg_critical, avg)
    assert dues == [False, False, True]  # the rule is not trivially true or false here
    strict = AutoInterval(k, 1.0)  # every weight must be due
    assert strict.observe(torch.tensor([10.0, 10.0]), torch.tensor([9.0, 1.0])) is False
    strict.restart()
    assert strict.steps == 0 and float(strict.non_critical.sum()) == 0.0


def _groups(world: int) -> tuple[list[ShardedGroup], list[nn.Parameter]]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 7)), nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(4, 6))]
    return [ShardedGroup(params, {}, world, r, 10_000, torch.float32) for r in range(world)], params


def test_selection_on_partitions_equals_whole_weights() -> None:
    groups, params = _groups(2)
    grads = [torch.randn_like(p) for p in params]
    parts = []
    for g in groups:  # each rank's reduced gradient partition, laid out like its master
        flat = torch.zeros(g.plan.partition_numel)
        for i, p in enumerate(params):
            lo, hi = g.plan.slots[i].owned_range(g.rank)
            s, _ = g.slot_range(i)
            flat[s:s + hi - lo] = grads[i].reshape(-1)[lo:hi]
        parts.append(flat)
    lays = [layout_of(g) for g in groups]
    sums = column_sums(parts[0], lays[0]) + column_sums(parts[1], lays[1])  # what the all-reduce adds
    torch.testing.assert_close(sums, torch.cat([grads[0].abs().sum(0), grads[2].abs().sum(0)]))
    cols = top_columns(sums, lays[0], 0.3)
    assert [c.numel() for c in cols] == [num_selected(7, 0.3), num_selected(6, 0.3)] == [2, 1]
    assert torch.equal(cols[0], torch.topk(grads[0].abs().sum(0), 2).indices.sort().values)
    for g, lay, part in zip(groups, lays, parts):  # each rank selects exactly its elements of those columns
        idx = selected_elements(lay, cols)
        want = []
        for i, p in enumerate(params):
            lo, hi = g.plan.slots[i].owned_range(g.rank)
            s, _ = g.slot_range(i)
            for f in range(lo, hi):
                if p.dim() != 2 or (f % p.shape[1]) in cols[[0, None, 1][i]].tolist():
                    want.append(s + f - lo)
        assert idx.tolist() == sorted(want)
    total, critical = matrix_sums(sums, lays[0], cols)
    torch.testing.assert_close(total, torch.stack([grads[0].abs().sum(), grads[2].abs().sum()]))
    torch.testing.assert_close(critical[1], grads[2].abs()[:, cols[1]].sum())
    assert num_selected(0, 0.3) == 0 and num_selected(3, 0.1) == 1  # DeepSpeed: at least one column
