"""1-bit Adam without processes: config names, DeepSpeed's import path, phases, masks and error buffers."""

from __future__ import annotations

import pytest
import torch

from zerospeed.config import ConfigError, load_config
from zerospeed.optim import build_optimizer
from zerospeed.optim.onebit import OnebitAdam


def params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]


def grads(step: int, ps: list[torch.nn.Parameter]) -> None:
    g = torch.Generator().manual_seed(step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("name", ["OneBitAdam", "onebitadam", "ONEBITADAM"])
def test_selectable_by_deepspeeds_name(name: str) -> None:
    opt = build_optimizer(name, {"lr": 0.01, "freeze_step": 7, "comm_backend_name": "compressed"},
                          [{"params": params()}])
    assert type(opt) is OnebitAdam and opt.freeze_step == 7 and opt.param_groups[0]["lr"] == 0.01


def test_deepspeed_import_path() -> None:
    from zerospeed.runtime.fp16.onebit import OnebitAdam as A
    from zerospeed.runtime.fp16.onebit.adam import OnebitAdam as B

    assert A is OnebitAdam and B is OnebitAdam


@pytest.mark.parametrize("params_, key", [({"amsgrad": True}, "optimizer.params.amsgrad"),
                                          ({"freeze_stepp": 3}, "optimizer.params.freeze_stepp"),
                                          ({"comm_backend_name": "udp"}, "optimizer.params")])
def test_bad_params_name_the_key(params_: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_optimizer("OneBitAdam", params_, [{"params": params()}])
    assert info.value.key == key


def test_zero_is_refused_with_deepspeeds_message() -> None:
    from zerospeed.runtime.build_optimizer import check_compressing as _check_compressing

    opt = OnebitAdam(params())
    assert _check_compressing(load_config({"train_micro_batch_size_per_gpu": 1}), opt)
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}})
    with pytest.raises(ConfigError, match="1bit-Adam is not compatible with ZeRO"):
        _check_compressing(cfg, opt)
    assert not _check_compressing(cfg, torch.optim.SGD(params(), lr=0.1))


def deepspeed_warmup(ps: list[torch.nn.Parameter], steps: int, lr: float, wd: float) -> list[torch.Tensor]:
    """DeepSpeed's OnebitAdam before freeze_step, written out: the first step moves nothing; then Adam
    without bias correction, weight decay added to the update."""
    ps = [p.detach().clone() for p in ps]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        gs = [torch.randn(p.shape, generator=gen) for p in ps]
        if step == 0:
            continue
        for p, g, m_, v_ in zip(ps, gs, m, v):
            m_.mul_(0.9).add_(g, alpha=0.1)
            v_.mul_(0.999).addcmul_(g, g, value=0.001)
            p.sub_(lr * (m_ / (v_.sqrt() + 1e-8) + wd * p))
    return ps


def test_warmup_is_adam_without_bias_correction_after_an_initialising_step() -> None:
    ps = params()
    start = [p.detach().clone() for p in ps]
    opt = OnebitAdam(ps, lr=0.01, weight_decay=0.1, freeze_step=100)
    grads(0, ps)
    opt.step()
    assert all(torch.equal(p, s) for p, s in zip(ps, start)), "the first call only initialises"
    assert opt.initialize and not opt.adam_freeze_key and opt.wants_backward_allreduce()
    for step in range(1, 6):
        grads(step, ps)
        opt.step()
    for p, want in zip(ps, deepspeed_warmup(start, 6, 0.01, 0.1)):
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=0)


def test_zerospeed_bias_correction_warms_up_as_torch_adam_and_corrects_the_frozen_variance() -> None:
    """Opt-in (zerospeed only): after the initialising call the warm-up is torch Adam's update; the frozen
    variance is divided by its bias correction at the freeze, 1 - b2^(freeze_step - 1)."""
    ps, ref = params(), params()
    opt = OnebitAdam(ps, lr=0.01, freeze_step=4, zerospeed_bias_correction=True)
    _steps_like_torch_adam(opt, ps, ref, 4)
    assert opt.adam_freeze_key
    before = [p.detach().clone() for p in ps]
    grads(4, ps)
    opt.step()  # world 1: the compressed average of one rank's momentum
    for p, b in zip(ps, before):
        st = opt.state[p]
        denom = (st["exp_avg_sq"] / (1 - 0.999 ** 3)).sqrt() + 1e-8
        torch.testing.assert_close(p.detach(), b - 0.01 * st["exp_avg"] / denom, rtol=1e-6, atol=1e-7)


def test_freeze_step_switches_the_engine_allreduce_off_and_freezes_the_variance() -> None:
    ps = params()
    opt = OnebitAdam(ps, lr=0.01, freeze_step=3)
    for step in range(3):
        assert opt.wants_backward_allreduce()
        grads(step, ps)
        opt.step()
    assert opt.adam_freeze_key and not opt.wants_backward_allreduce()
    v = [opt.state[p]["exp_avg_sq"].clone() for p in ps]
    m = [opt.state[p]["exp_avg"].clone() for p in ps]
    grads(3, ps)
    opt.step()
    assert all(torch.equal(opt.state[p]["exp_avg_sq"], v_) for p, v_ in zip(ps, v)), "variance frozen"
    assert not any(torch.equal(opt.state[p]["exp_avg"], m_) for p, m_ in zip(ps, m)), "momentum moves"


def test_exp_avg_mask_kept_on_load_and_error_buffers_reset() -> None:
    ps = params()
    mask = torch.ones(5, 3)
    mask[4] = 0.0
    opt = OnebitAdam([{"params": [ps[0]], "exp_avg_mask": mask}, {"params": [ps[1]]}], lr=0.01, freeze_step=2)
    for step in range(4):
        grads(step, ps)
        opt.step()
    assert torch.equal(opt.state[ps[0]]["exp_avg"][4], torch.zeros(3)), "masked rows stay exactly zero"
    we, _ = opt.error_buffers(ps[0])
    we.fill_(1.0)
    assert opt.error_buffers(ps[0])[0] is we
    saved = opt.state_dict()
    assert all("worker_error" not in s and "server_error" not in s for s in saved["state"].values())
    other = torch.zeros(5, 3)
    saved["param_groups"][0]["exp_avg_mask"] = other
    saved["param_groups"][1]["exp_avg_mask"] = other
    opt.load_state_dict(saved)
    assert torch.equal(opt.param_groups[0]["exp_avg_mask"], mask) and "exp_avg_mask" not in opt.param_groups[1]
    assert torch.equal(opt.error_buffers(ps[0])[0], torch.zeros_like(we)), "errors reset on load"
    assert opt.adam_freeze_key, "the phase follows the loaded step count"
    opt.state[ps[0]] = dict(opt.state[ps[0]])  # the engine's checkpoint load replaces state dicts
    assert opt.error_buffers(ps[0])[0].abs().sum() == 0


def test_zero_one_adam_by_name_and_path() -> None:
    from zerospeed.optim.onebit import ZeroOneAdam
    from zerospeed.runtime.fp16.onebit import ZeroOneAdam as A
    from zerospeed.runtime.fp16.onebit.zoadam import ZeroOneAdam as B

    opt = build_optimizer("zerooneadam", {"var_freeze_step": 5, "var_update_scaler": 2, "local_step_clipper": 4},
                          [{"params": params()}])
    assert type(opt) is ZeroOneAdam and A is ZeroOneAdam and B is ZeroOneAdam
    assert (opt.var_freeze_step, opt.var_update_scaler, opt.local_step_scaler, opt.local_step_clipper) == (5, 2, 32678, 4)


def test_zero_one_adam_variance_interval_doubles() -> None:
    """DeepSpeed's rule: the engine all-reduces before a step iff it updates the variance (step % interval
    == 0); every var_update_scaler variance updates the interval doubles (1, 2, 4, ...)."""
    from zerospeed.optim.onebit import ZeroOneAdam

    ps = params()
    opt = ZeroOneAdam(ps, lr=0.01, var_update_scaler=2)
    gates, v_moved = [], []
    for step in range(12):
        gates.append(opt.wants_backward_allreduce())
        before = opt.state[ps[0]]["exp_avg_sq"].clone() if ps[0] in opt.state else None
        grads(step, ps)
        opt.step()
        v_moved.append(before is not None and not torch.equal(before, opt.state[ps[0]]["exp_avg_sq"]))
    assert gates == [True, True, True, True, False, True, False, True, False, False, False, True]
    assert v_moved == [False] + gates[1:]  # the first call only initialises
    assert opt.state[ps[0]]["var_interval"] == 8


def test_zero_one_adam_local_steps_after_var_freeze_step() -> None:
    from zerospeed.optim.onebit import ZeroOneAdam

    ps = params()
    opt = ZeroOneAdam(ps, lr=0.01, var_freeze_step=3, local_step_scaler=2, local_step_clipper=4)
    for step in range(4):
        grads(step, ps)
        opt.step()
    assert opt.freeze_key and not opt.wants_backward_allreduce()
    v = opt.state[ps[0]]["exp_avg_sq"].clone()
    intervals, pending = [], []
    for step in range(4, 14):
        grads(step, ps)
        opt.step()
        st = opt.state[ps[0]]
        intervals.append(st["local_step_interval"])
        pending.append(bool(st["momentum_accumulator"].abs().sum() > 0))
    assert torch.equal(opt.state[ps[0]]["exp_avg_sq"], v), "variance frozen"
    assert intervals == [1, 2, 2, 4, 4, 4, 4, 4, 4, 4]  # doubles every 2 local steps, clipped at 4
    # the accumulated local change is synchronised (and cleared) on steps that are multiples of the interval
    assert pending == [False, False, True, False, True, True, True, False, True, True]


def test_zero_one_adam_bias_correction_is_torch_adam_while_every_step_updates_the_variance() -> None:
    """zerospeed_bias_correction (zerospeed only): with var_interval 1 the update is torch Adam's."""
    from zerospeed.optim.onebit import ZeroOneAdam

    ps, ref = params(), params()
    opt = ZeroOneAdam(ps, lr=0.01, var_update_scaler=100, zerospeed_bias_correction=True)
    _steps_like_torch_adam(opt, ps, ref, 6)


def zero_one_adam_bias_corrected(ps: list[torch.nn.Parameter], steps: int, lr: float, scaler: int,
                                 freeze: int) -> list[torch.Tensor]:
    """0/1 Adam with zerospeed_bias_correction at world 1, written out: the variance moves on steps that are
    multiples of an interval doubling every ``scaler`` updates, k of them so far; after ``freeze`` the
    variance and k stay, the momentum is used uncorrected (a local step synchronised at once: a no-op)."""
    ps = [p.detach().clone() for p in ps]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    k, interval, counter = 0, 1, 0
    for call in range(steps):
        gen = torch.Generator().manual_seed(call)
        gs = [torch.randn(p.shape, generator=gen) for p in ps]
        step = call + 1
        if step == 1:
            continue
        frozen = step - 1 > freeze
        var_step = not frozen and step % interval == 0
        if var_step:
            k += 1
        for p, g, m_, v_ in zip(ps, gs, m, v):
            if var_step:
                v_.mul_(0.999).addcmul_(g, g, value=0.001)
            m_.mul_(0.9).add_(g, alpha=0.1)
            mh = m_ if frozen else m_ / (1 - 0.9 ** (step - 1))
            p.sub_(lr * mh / ((v_ / (1 - 0.999 ** k)).sqrt() + 1e-8))
        if var_step:
            counter += 1
            if counter == scaler:
                counter, interval = 0, interval * 2
    return ps


def test_zero_one_adam_bias_correction_counts_variance_updates_and_freezes_them() -> None:
    from zerospeed.optim.onebit import ZeroOneAdam

    ps = params()
    start = [p.detach().clone() for p in ps]
    opt = ZeroOneAdam(ps, lr=0.01, var_update_scaler=2, var_freeze_step=9, zerospeed_bias_correction=True)
    for step in range(14):
        grads(step, ps)
        opt.step()
    assert opt.freeze_key and opt.state[ps[0]]["var_interval"] == 4
    for p, want in zip(ps, zero_one_adam_bias_corrected(start, 14, 0.01, 2, 9)):
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)
    off = ZeroOneAdam(params(), lr=0.01, var_update_scaler=2, var_freeze_step=9)
    assert not off.zerospeed_bias_correction, "off by default (DeepSpeed's update)"
    assert build_optimizer("ZeroOneAdam", {"zerospeed_bias_correction": True},
                           [{"params": params()}]).zerospeed_bias_correction


def lamb_warmup(ps: list[torch.nn.Parameter], steps: int, lr: float, wd: float) -> tuple[list[torch.Tensor], list[float]]:
    """DeepSpeed's OnebitLamb before freeze_step, written out: LAMB without bias correction, trust ratio
    clamped to [0.01, 10], the first step only initialises. Returns weights and the EMA of the ratios."""
    ps = [p.detach().clone() for p in ps]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    ema = [0.0 for _ in ps]
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        gs = [torch.randn(p.shape, generator=gen) for p in ps]
        if step == 0:
            continue
        for i, (p, g) in enumerate(zip(ps, gs)):
            m[i].mul_(0.9).add_(g, alpha=0.1)
            v[i].mul_(0.999).addcmul_(g, g, value=0.001)
            u = m[i] / (v[i].sqrt() + 1e-8) + wd * p
            ratio = min(max((p.norm() / u.norm()).item(), 0.01), 10.0)
            ema[i] = 0.9 * ema[i] + 0.1 * ratio
            p.sub_(lr * ratio * u)
    return ps, ema


def test_onebit_lamb_by_name_path_and_warmup() -> None:
    from zerospeed.optim.onebit import OnebitLamb
    from zerospeed.runtime.fp16.onebit import OnebitLamb as A
    from zerospeed.runtime.fp16.onebit.lamb import OnebitLamb as B

    ps = params()
    start = [p.detach().clone() for p in ps]
    opt = build_optimizer("OneBitLamb", {"lr": 0.01, "weight_decay": 0.1, "freeze_step": 100, "factor_max": 3.0},
                          [{"params": ps}])
    assert type(opt) is OnebitLamb and A is OnebitLamb and B is OnebitLamb and opt.factor_max == 3.0
    for step in range(6):
        grads(step, ps)
        opt.step()
    want, ema = lamb_warmup(start, 6, 0.01, 0.1)
    for p, w, e in zip(ps, want, ema):
        torch.testing.assert_close(p.detach(), w, rtol=1e-6, atol=0)
        assert abs(opt.state[p]["lamb_coeff_freeze"] - e) < 1e-6
    assert len(opt.get_lamb_coeffs()) == 2


def test_onebit_lamb_compression_phase_freezes_ratio_and_clamps_factor() -> None:
    from zerospeed.optim.onebit import OnebitLamb

    ps = params()
    opt = OnebitLamb(ps, lr=0.01, freeze_step=4, factor_threshold=0.1)
    for step in range(4):
        grads(step, ps)
        opt.step()
    assert opt.lamb_freeze_key and not opt.wants_backward_allreduce()
    frozen = {p: opt.state[p]["lamb_coeff_freeze"] for p in ps}
    v = [opt.state[p]["exp_avg_sq"].clone() for p in ps]
    assert all(torch.equal(opt.state[p]["exp_avg_sq_fresh"], v_) for p, v_ in zip(ps, v)), "fresh = v at freeze_step"
    last = {p: 1.0 for p in ps}
    for step in range(4, 9):
        grads(step, ps)
        opt.step()
        for p, coeff in zip(ps, opt.get_lamb_coeffs()):
            factor = opt.state[p]["last_factor"]
            assert 0.9 * last[p] - 1e-12 <= factor <= 1.1 * last[p] + 1e-12 and 0.5 <= factor <= 4.0
            assert coeff == pytest.approx(frozen[p] * factor)
            last[p] = factor
    assert all(torch.equal(opt.state[p]["exp_avg_sq"], v_) for p, v_ in zip(ps, v)), "variance frozen"
    assert not any(torch.equal(opt.state[p]["exp_avg_sq_fresh"], v_) for p, v_ in zip(ps, v)), "fresh one moves"
    assert all(opt.state[p]["scaling_coeff"] > 0 for p in ps)


def _steps_like_torch_adam(opt, ps, ref, steps: int) -> None:
    """After a first (initialising) step, ``opt`` over ``ps`` moves like torch Adam (lr 0.01) over ``ref``."""
    adam = torch.optim.Adam(ref, lr=0.01)
    grads(0, ps)
    opt.step()
    for step in range(1, steps):
        grads(step, ps)
        grads(step, ref)
        opt.step()
        adam.step()
    for p, q in zip(ps, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
