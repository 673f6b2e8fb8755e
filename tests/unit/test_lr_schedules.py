"""LR schedules against DeepSpeed's formulas, computed here by hand (independent of the implementation).

Convention checked throughout: the constructor writes the lr of optimizer step 1; the k-th ``step()`` sets
``last_batch_iteration = k - 1`` and writes the lr of optimizer step k + 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from zerospeed.config.errors import ConfigError, NotSupportedYetError
from zerospeed.optim import SCHEDULER_NAMES, build_scheduler


def sgd(lr: float = 0.5, groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)], lr=lr)


def adam(lr: float = 0.5) -> torch.optim.Optimizer:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=lr, betas=(0.95, 0.999))


def trace(sched, opt, steps: int) -> list[float]:
    """lr of group 0 before each of ``steps`` optimizer steps (construction, then after each step())."""
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        assert sched.get_last_lr()[0] == pytest.approx(opt.param_groups[0]["lr"])
        sched.step()
    return out


def test_names():
    assert set(SCHEDULER_NAMES) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}


def test_warmup_linear_hand_values():
    opt = sgd()
    s = build_scheduler("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 4,
                                     "warmup_type": "linear"}, opt)
    assert trace(s, opt, 8) == pytest.approx([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    assert s.last_batch_iteration == 7


def test_warmup_log_30_steps():
    lo, hi, n = 0.01, 0.1, 10
    opt = sgd()
    s = build_scheduler("WarmupLR", {"warmup_min_lr": lo, "warmup_max_lr": hi, "warmup_num_steps": n}, opt)
    expected = [lo]  # construction
    for i in range(29):  # step() k sets iteration k - 1
        expected.append(hi if i >= n else lo + (hi - lo) * math.log(i + 1) / math.log(n))
    got = trace(s, opt, 30)
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[1] == lo and got[2] == pytest.approx(lo + 0.09 * math.log(2) / math.log(10))
    assert got[10] == pytest.approx(hi) and got[11] == hi  # iteration 9 = log(10)/log(10) = 1


def test_warmup_log_differs_from_linear():
    a, b = sgd(), sgd()
    sa = build_scheduler("WarmupLR", {"warmup_max_lr": 1.0, "warmup_num_steps": 10, "warmup_type": "log"}, a)
    sb = build_scheduler("WarmupLR", {"warmup_max_lr": 1.0, "warmup_num_steps": 10, "warmup_type": "linear"}, b)
    la, lb = trace(sa, a, 12), trace(sb, b, 12)
    assert la[3] == pytest.approx(math.log(3) / math.log(10)) and lb[3] == pytest.approx(0.2)
    assert la[-1] == lb[-1] == 1.0


def test_warmup_max_lr_defaults_to_optimizer_lr_and_num_steps_floor_of_two():
    opt = sgd(lr=0.3)
    s = build_scheduler("WarmupLR", {"warmup_num_steps": 1, "warmup_type": "linear"}, opt)
    # warmup_num_steps 1 becomes 2 (DeepSpeed): iterations 0, 1 give 0, 0.5 of the way
    assert trace(s, opt, 5) == pytest.approx([0.0, 0.0, 0.15, 0.3, 0.3])


def test_warmup_decay_linear_hand_values():
    opt = sgd()
    s = build_scheduler("WarmupDecayLR", {"total_num_steps": 20, "warmup_max_lr": 1.0, "warmup_num_steps": 5,
                                          "warmup_type": "linear"}, opt)
    got = trace(s, opt, 30)
    expected = [0.0] + [i / 5 if i < 5 else max(0.0, (20 - i) / 15) for i in range(29)]
    assert got == pytest.approx(expected)
    assert got[6] == pytest.approx(1.0) and got[11] == pytest.approx(10 / 15) and got[21] == 0.0 and got[29] == 0.0


def test_warmup_decay_default_max_lr_is_one_thousandth():
    opt = sgd(lr=0.5)
    s = build_scheduler("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 2}, opt)
    s.step(2)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.001)


def test_warmup_cosine_30_steps():
    base, n, total, wmin, cmin = 0.2, 5, 20, 0.1, 0.01
    opt = sgd(lr=base)
    s = build_scheduler("WarmupCosineLR", {"total_num_steps": total, "warmup_num_steps": n, "warmup_min_ratio": wmin,
                                           "cos_min_ratio": cmin, "warmup_type": "linear"}, opt)
    expected = [0.0]  # DeepSpeed writes 0 at construction
    for i in range(29):
        if i < n:
            ratio = wmin + (1 - wmin) * i / n
        else:
            p = min(1.0, (i - n + 1) / (total - n))
            ratio = cmin + (1 - cmin) * (1 + math.cos(math.pi * p)) / 2
        expected.append(base * ratio)
    got = trace(s, opt, 30)
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[1] == pytest.approx(0.02)
    assert got[20] == pytest.approx(base * cmin) and got[29] == pytest.approx(base * cmin)


def test_warmup_cosine_log_warmup_and_defaults():
    opt = sgd(lr=1.0)
    s = build_scheduler("WarmupCosineLR", {"total_num_steps": 100, "warmup_num_steps": 10}, opt)
    got = trace(s, opt, 4)
    assert got == pytest.approx([0.0, 0.0, math.log(2) / math.log(10), math.log(3) / math.log(10)])
    s.step(99)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0001)  # cos_min_ratio default


def test_one_cycle_lr_and_momentum():
    opt = adam()
    s = build_scheduler("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 4,
                                     "cycle_second_step_size": 6, "decay_step_size": 2, "decay_lr_rate": 0.5,
                                     "decay_mom_rate": 0.1, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9}, opt)
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["betas"] == (0.8, 0.99)
    assert s.get_mom()[0] == (0.9, 0.99)  # DeepSpeed: before a step, the cycle's position 0 (max), not the groups'
    lrs, moms = [], []
    for _ in range(14):
        s.step()
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"][0])
        assert opt.param_groups[0]["betas"][1] == 0.99
    # iteration i uses cycle position i + 1: up over 4 steps, down over 6, then decay d = i - 9 steps
    heights = [1 / 4, 2 / 4, 3 / 4, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0]
    exp_lrs = [0.1 + 0.9 * h for h in heights] + [0.1 / (1 + 0.5 * d / 2) for d in (1, 2, 3, 4)]
    exp_moms = [0.9 - 0.1 * h for h in heights] + [0.9 * (1 + 0.1 * d / 2) for d in (1, 2, 3, 4)]
    assert lrs == pytest.approx(exp_lrs, rel=1e-12)
    assert moms == pytest.approx(exp_moms, rel=1e-12)
    assert lrs[3] == pytest.approx(1.0) and moms[3] == pytest.approx(0.8) and lrs[10] == pytest.approx(0.08)
    assert s.get_mom()[0][0] == pytest.approx(moms[-1])


def test_one_cycle_stairs_and_no_decay():
    opt = adam()
    s = build_scheduler("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_first_step_size": 4,
                                     "cycle_first_stair_count": 2, "cycle_momentum": False}, opt)
    assert opt.param_groups[0]["betas"] == (0.95, 0.999)  # untouched without cycle_momentum
    lrs = []
    for _ in range(12):
        s.step()
        lrs.append(opt.param_groups[0]["lr"])
    # positions 1..8 of a 4 + 4 cycle in 2 stairs per half, then flat at min (decay off by default)
    assert lrs == pytest.approx([0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert opt.param_groups[0]["betas"] == (0.95, 0.999)


def test_one_cycle_sgd_warns_and_cycles_only_lr():
    opt = sgd()
    with pytest.warns(UserWarning, match="cycle_momentum"):
        s = build_scheduler("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_first_step_size": 2}, opt)
    s.step()
    assert "betas" not in opt.param_groups[0] and opt.param_groups[0]["lr"] == pytest.approx(0.15)


def test_lr_range_test_continuous_and_staircase():
    a, b = sgd(), sgd()
    sa = build_scheduler("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 5,
                                         "lr_range_test_step_rate": 2.0}, a)
    sb = build_scheduler("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 5,
                                         "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True}, b)
    la, lb = trace(sa, a, 30), trace(sb, b, 30)
    assert la == pytest.approx([0.01] + [0.01 * (1 + 2 * (i + 1) / 5) for i in range(29)])
    assert lb == pytest.approx([0.01] + [0.01 * (1 + 2 * ((i + 1) // 5)) for i in range(29)])
    assert lb[4] == pytest.approx(0.01) and lb[5] == pytest.approx(0.03)


def test_lr_applied_by_optimizer_steps_matches_schedule():
    """The lr an SGD step applies (grad 1): step 1 uses the constructor's lr, step k + 1 the k-th step()'s."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    s = build_scheduler("WarmupLR", {"warmup_max_lr": 1.0, "warmup_num_steps": 4, "warmup_type": "linear",
                                     "warmup_min_lr": 0.1}, opt)
    applied = []
    for _ in range(6):
        before = p.item()
        p.grad = torch.ones(1)
        opt.step()
        applied.append(before - p.item())
        s.step()
    assert applied == pytest.approx([0.1, 0.1, 0.325, 0.55, 0.775, 1.0], abs=1e-6)


def test_per_group_lists():
    opt = sgd(groups=2)
    s = build_scheduler("WarmupLR", {"warmup_min_lr": [0.0, 0.1], "warmup_max_lr": [1.0, 0.5],
                                     "warmup_num_steps": 2, "warmup_type": "linear"}, opt)
    assert s.get_last_lr() == [0.0, 0.1]
    s.step(1)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.3])
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_max_lr.*2 values"):
        build_scheduler("WarmupLR", {"warmup_max_lr": [1.0, 0.5, 0.2]}, opt)


def test_tensor_lr_stays_the_same_tensor():
    given = torch.full((1,), 0.1, dtype=torch.float64)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=given)
    s = build_scheduler("WarmupLR", {"warmup_max_lr": 0.1, "warmup_min_lr": 0.05}, opt)
    s.step(10)
    lr = opt.param_groups[0]["lr"]  # written in place: the optimizer's (and the caller's) tensor, dtype and shape
    assert lr is given and lr.dtype == torch.float64 and lr.shape == (1,) and float(lr) > 0.05


def test_state_dict_round_trip():
    params = {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 5}
    a = adam()
    sa = build_scheduler("OneCycle", params, a)
    for _ in range(7):
        sa.step()
    sd = sa.state_dict()
    assert sd == {"last_batch_iteration": 6}
    b = adam()
    sb = build_scheduler("OneCycle", params, b)
    sb.load_state_dict(sd)
    assert sb.last_batch_iteration == 6
    assert b.param_groups[0]["lr"] == pytest.approx(a.param_groups[0]["lr"])
    assert b.param_groups[0]["betas"] == pytest.approx(a.param_groups[0]["betas"])
    sa.step()
    sb.step()
    assert sb.get_last_lr() == sa.get_last_lr() and sb.get_lr() == sa.get_lr()


def test_type_is_case_insensitive():
    assert type(build_scheduler("warmuplr", {}, sgd())).__name__ == "WarmupLR"


@pytest.mark.parametrize(
    ("type_name", "params", "key", "hint"),
    [
        ("WarmupLRR", {}, "scheduler.type", "Did you mean 'WarmupLR'"),
        ("WarmupLR", {"warmup_max_lrr": 1.0}, "scheduler.params.warmup_max_lrr", "Did you mean 'warmup_max_lr'"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_momentun": True},
         "scheduler.params.cycle_momentun", "Did you mean 'cycle_momentum'"),
        ("WarmupDecayLR", {}, "scheduler.params.total_num_steps", "required"),
        ("WarmupLR", {"warmup_num_steps": "auto"}, "scheduler.params.warmup_num_steps", "auto"),
        ("WarmupLR", {"warmup_type": "cosine"}, "scheduler.params.warmup_type", "'log' or 'linear'"),
        ("WarmupLR", {"warmup_num_steps": 0}, "scheduler.params.warmup_num_steps", "greater than 0"),
        ("LRRangeTest", {"lr_range_test_step_size": 0}, "scheduler.params.lr_range_test_step_size", "greater"),
    ],
)
def test_bad_config_names_key(type_name, params, key, hint):
    with pytest.raises(ConfigError) as info:
        build_scheduler(type_name, params, sgd())
    assert info.value.key == key and hint in str(info.value)


def test_not_supported_yet():
    with pytest.raises(NotSupportedYetError, match="StepLR"):
        build_scheduler("StepLR", {"step_size": 2}, sgd())
    with pytest.raises(NotSupportedYetError, match="last_batch_iteration"):
        build_scheduler("WarmupLR", {"last_batch_iteration": 5}, sgd())


def test_one_cycle_per_group_values_and_a_climb_only_cycle():
    opt = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2}])
    s = build_scheduler("OneCycle", {"cycle_min_lr": [0.001, 0.002], "cycle_max_lr": [0.01, 0.02],
                                     "cycle_min_mom": [0.8, 0.85], "cycle_max_mom": [0.9, 0.95],
                                     "cycle_first_step_size": 5}, opt)
    s.step(4)  # the peak: each group at its own max lr and min momentum
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01, 0.02])
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([0.8, 0.85])
    with pytest.raises(ConfigError, match="cycle_max_mom.*2 values"):
        build_scheduler("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_max_mom": [0.9]}, opt)
    climb = build_scheduler("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 4,
                                         "cycle_second_step_size": 0}, opt)
    assert climb.step_ratio == 1.0
    climb.step(2)
    assert climb.get_lr() == pytest.approx([0.1 + 0.9 * 3 / 4] * 2)


def test_warmup_lr_without_max_warms_each_group_to_its_own_lr():
    opt = sgd(groups=2)
    for group, lr in zip(opt.param_groups, (0.1, 0.2)):
        group["lr"] = lr
    s = build_scheduler("WarmupLR", {"warmup_num_steps": 4}, opt)
    s.step(4)
    assert s.get_last_lr() == pytest.approx([0.1, 0.2])


def test_call_to_str_is_an_instructions_text():
    from zerospeed.runtime.utils import call_to_str
    from zerospeed.runtime.pipe.schedule import ForwardPass

    assert call_to_str("f", 3, "x", val=1) == "f(3, 'x', val=1)" and call_to_str("g") == "g()"
    assert repr(ForwardPass(buffer_id=2)) == "ForwardPass(buffer_id=2)"
