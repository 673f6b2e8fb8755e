"""``load_checkpoint``'s flags restore exactly what they say (public API only, world 2).

Two checkpoints of one run: ``s`` after 3 steps, ``t`` after 6. Each case first loads ``t`` (the engine is
then in state T), loads ``s`` with the flags, and checks every piece of state against S or T:
module weights (and the fp32 masters the next step trains from), optimizer state, LR-scheduler state and
the step counters.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .ckpt_common import build, full_state, train

CASES: dict[str, dict[str, bool]] = {
    "all": {},
    "no_optimizer": {"load_optimizer_states": False},
    "no_scheduler": {"load_lr_scheduler_states": False},
    "module_only": {"load_module_only": True},
}


def _optimizer_state(engine: Any) -> list[torch.Tensor]:
    """This rank's optimizer state tensors (its shard), in a fixed order."""
    opt = engine.optimizer.optimizer
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            for key in sorted(opt.state.get(p, {})):
                value = opt.state[p][key]
                out.append(value.detach().clone() if torch.is_tensor(value) else torch.tensor(float(value)))
    return out


def _snapshot(engine: Any) -> dict[str, Any]:
    return {"module": full_state(engine), "master": full_state(engine, fp32=True), "opt": _optimizer_state(engine),
            "sched": dict(engine.lr_scheduler.state_dict()), "steps": engine.global_steps}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b


def _run(stage: int, path: str) -> dict[str, dict[str, bool]]:
    engine = build(stage)
    train(engine, 3)
    engine.save_checkpoint(path, tag="s")
    s = _snapshot(engine)
    train(engine, 3)
    engine.save_checkpoint(path, tag="t")
    t = _snapshot(engine)
    assert not _same(s["opt"], t["opt"]) and s["sched"] != t["sched"] and not _same(s["module"], t["module"])
    found: dict[str, dict[str, bool]] = {}
    for case, flags in CASES.items():
        engine.load_checkpoint(path, tag="t")
        assert _same(_snapshot(engine), t), "loading t must restore T exactly"
        engine.load_checkpoint(path, tag="s", **flags)
        now = _snapshot(engine)
        found[case] = {k: _same(now[k], s[k]) for k in s}
        found[case].update({f"{k}_is_t": _same(now[k], t[k]) for k in s})
    train(engine, 1)  # still trains after the last load
    return found


@pytest.mark.parametrize("stage", [1, 2])
def test_load_flags_restore_what_they_name(stage: int, tmp_path: Any) -> None:
    for found in run_distributed(_run, 2, stage, str(tmp_path), timeout=120):
        for case in CASES:
            f = found[case]
            assert f["module"] and f["master"], (case, f)  # weights (and the masters) always come from s
        assert found["all"] == {**found["all"], "opt": True, "sched": True, "steps": True}
        assert found["no_optimizer"]["opt_is_t"] and found["no_optimizer"]["sched"]
        assert found["no_scheduler"]["opt"] and found["no_scheduler"]["sched_is_t"]
        assert found["module_only"]["opt_is_t"] and found["module_only"]["sched_is_t"]
        assert found["module_only"]["steps_is_t"], "load_module_only keeps the engine's step counters"
