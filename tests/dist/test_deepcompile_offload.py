"""DeepCompile's three offload passes at ZeRO-3 (``compile.offload_opt_states``, ``offload_parameters``,
``offload_activation``), world 2, the demo GPT at a tiny size, gradient accumulation 2, ``aot_eager``.

One distributed run trains eager ZeRO-3 and DeepCompile ZeRO-3 with each pass; each pass must give eager's
losses and parameters (rtol 1e-5), and is observed at work between each forward and its backward:

* optimizer states: every state tensor is its host buffer (from the second step on, when states exist), and a
  fresh device tensor after the step;
* parameters: every partitioned shard lives in a host home, not resident, and the home holds its value;
* activations: the saved activations the plan picked (here: all those of at least the floor, the budget being
  set below what is allocated) are host copies while the backward has not run, and read back by it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import zerospeed
from zerospeed.testing import run_distributed

from .test_deepcompile import MB, SEQ, _batch, _gpt

STEPS, GAS, LR = 3, 2, 1e-2
FLOOR = 2000  # bytes: the 4 KiB MLP activations and the 2 KiB logits go; the 1 KiB ones stay


def _config(compile_cfg: dict[str, Any]) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 16, "reduce_bucket_size": 300},
            "compile": compile_cfg}


def _observe(engine: Any, which: str) -> dict[str, Any]:
    """What the pass left on the host between a forward and its backward."""
    dc = engine.deepcompiled
    if which == "offload_opt_states":
        off = dc.opt_offload
        states = [v for st in off.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
        hosted = sum(any(v is h for h in off.host.values()) for v in states)
        return {"on_host": off.on_host, "states": len(states), "hosted": hosted}
    if which == "offload_parameters":
        cut = [s for s in engine.zero3.shards if s.local is not None]
        return {"cut": len(cut), "homed": sum(s.home is dc.param_home and not s.resident and s.home_key in
                                              dc.param_home.host for s in cut)}
    g = dc.graph
    return {"host_bytes": g.act_host_bytes, "offloads": g.act_offloads, "reloads": g.act_reloads}


def _train(which: str | None) -> dict[str, Any]:
    from zerospeed import comm
    from zerospeed.zero import full_state_dict

    if which == "offload_activation":  # DeepSpeed's test hooks: a budget below what is allocated, a tiny floor
        os.environ.update(DS_DC_OFFLOAD_ACT_BUDGET_GB="0.001", DS_DC_OFFLOAD_ACT_MIN_SIZE_MB=str(FLOOR / 2**20))
    world, rank = comm.get_world_size(), comm.get_rank()
    model = _gpt()
    cfg = _config({} if which is None else {"deepcompile": True, which: True})
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    torch._dynamo.reset()
    if which is not None:
        engine.compile(backend="aot_eager")
    out: dict[str, Any] = {"losses": [], "seen": [], "after_step": []}
    for step in range(STEPS):
        total = 0.0
        for micro in range(GAS):
            idx = _batch(step, micro, rank, world)
            _, loss = engine(idx, idx)
            if which is not None:
                out["seen"].append(_observe(engine, which))
            engine.backward(loss)
            engine.step()
            total += float(loss.detach()) / GAS
        if which is not None:
            out["after_step"].append(_observe(engine, which))
        summed = torch.tensor(total)
        comm.all_reduce(summed)
        out["losses"].append(float(summed) / world)
    if which == "offload_activation":
        out["offloaded"] = engine.deepcompiled.offloaded
        for k in ("DS_DC_OFFLOAD_ACT_BUDGET_GB", "DS_DC_OFFLOAD_ACT_MIN_SIZE_MB"):
            os.environ.pop(k)
    if which == "offload_opt_states":
        out["counts"] = (engine.deepcompiled.opt_offload.offloads, engine.deepcompiled.opt_offload.reloads)
    out["passes"] = None if which is None else engine.deepcompiled.passes
    out["state"] = {k: v.float().clone() for k, v in full_state_dict(model, group=engine.dp_group).items()}
    return out


PASSES = ("offload_opt_states", "offload_parameters", "offload_activation")


def _all() -> dict[str, Any]:
    return {str(w): _train(w) for w in (None, *PASSES)}


def test_deepcompile_offload_passes_equal_eager_zero3_and_run() -> None:
    result = run_distributed(_all, 2, timeout=600)[0]
    eager = result["None"]
    for which in PASSES:
        run = result[which]
        torch.testing.assert_close(run["losses"], eager["losses"], rtol=1e-5, atol=1e-6, msg=which)
        for key, ref in eager["state"].items():
            torch.testing.assert_close(run["state"][key], ref, rtol=1e-5, atol=2e-5, msg=f"{which} {key}")
    assert result["offload_opt_states"]["passes"] == ("zero3_compile", "offload_adam_states")
    opt = result["offload_opt_states"]
    first, later = opt["seen"][:GAS], opt["seen"][GAS:]
    assert all(not s["on_host"] and s["states"] == 0 for s in first), first  # no state before the first step
    assert all(s["on_host"] and s["states"] > 0 and s["hosted"] == s["states"] for s in later), later
    assert all(not s["on_host"] and s["hosted"] == 0 for s in opt["after_step"]), opt["after_step"]
    assert opt["counts"] == (STEPS - 1, STEPS - 1)  # out once per step (both micro-steps), back for the step
    par = result["offload_parameters"]
    assert all(s["cut"] > 0 and s["homed"] == s["cut"] for s in par["seen"] + par["after_step"]), par["seen"]
    act = result["offload_activation"]
    plans = act["offloaded"]
    assert len(plans) == 1, plans  # one graph
    moved, kept = plans[0]["moved"], plans[0]["kept"]
    # only what the plan says: with no budget left, every saved activation of at least the floor, and no other
    assert moved and kept and all(n >= FLOOR for _, n in moved) and all(n < FLOOR for _, n in kept), plans
    per_forward = len(moved)
    for i, s in enumerate(act["seen"]):  # host copies held between forward and backward, read back by it
        assert s["host_bytes"] == sum(n for _, n in moved) and s["offloads"] == per_forward * (i + 1), (i, s)
        assert s["reloads"] == per_forward * i, (i, s)
    assert all(s["host_bytes"] == 0 for s in act["after_step"]), act["after_step"]
