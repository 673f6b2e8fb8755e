"""DeepCompile's offload passes without processes: the activation plan, the graph rewrite on a real AOTAutograd
partition, the optimizer-state round trip, and the refused combinations (runtime/plan.py); and AutoEP regional
compile's (``compile.autoep_non_moe``) refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.config import ConfigError, load_config
from zerospeed.runtime.deepcompile_offload import OptStateOffload
from zerospeed.runtime.plan import ModelFacts, OptimizerFacts, plan_training
from zerospeed.zero.stage3.graph_offload import (OFFLOAD, RELOAD, activation_budget, offload_partition,
                                                 plan_offload)
from zerospeed.zero.stage3.graph_ops import GraphUnits


def test_plan_keeps_the_largest_that_fit_and_moves_only_eligible_ones() -> None:
    saved = [("a", 100), ("b", 400), ("c", 10), ("d", 300), ("e", 200)]
    assert plan_offload(saved, budget=10_000, min_bytes=50) == []  # everything fits: nothing must go
    # 10 bytes of ineligible "c" first; then 400 fits in 610, 300 does not, 200 does: "a" and "d" go
    assert plan_offload(saved, budget=610, min_bytes=50) == ["a", "d"]
    assert plan_offload(saved, budget=0, min_bytes=150) == ["b", "d", "e"]  # no room: every eligible one
    assert plan_offload(saved, budget=-5, min_bytes=1000) == []  # none eligible


def test_budget_reads_deepspeeds_test_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DS_DC_OFFLOAD_ACT_BUDGET_GB", raising=False)
    monkeypatch.delenv("DS_DC_OFFLOAD_ACT_MIN_SIZE_MB", raising=False)
    assert activation_budget(1000, 100) == (800.0, 5 * 1024 * 1024)  # 10 % margin, less what is allocated
    monkeypatch.setenv("DS_DC_OFFLOAD_ACT_BUDGET_GB", "2")
    monkeypatch.setenv("DS_DC_OFFLOAD_ACT_MIN_SIZE_MB", "0.5")
    assert activation_budget(1000, 100) == (2e9 - 100, 512 * 1024)


def _f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w)  # saved: (8, 64) fp32, 2 KiB
    s = torch.sigmoid(h.sum(dim=1, keepdim=True))  # saved: (8, 1), 32 bytes
    return (h * s).sum()


def test_partition_moves_the_planned_activations_to_host_and_reads_them_back() -> None:
    from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition

    units = GraphUnits([], lambda p, g: None)
    graphs: dict[str, torch.fx.GraphModule] = {}
    plans: list[dict[str, Any]] = []

    def compiler(name: str) -> Any:
        def run(gm: torch.fx.GraphModule, _: Any) -> Any:
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return run

    partition = offload_partition(min_cut_rematerialization_partition, units.handle, budget=0, min_bytes=1024,
                                  pin=False, plans=plans)
    compiled = aot_function(_f, fw_compiler=compiler("fw"), bw_compiler=compiler("bw"), partition_fn=partition)
    x, w = torch.randn(8, 16), torch.randn(16, 64, requires_grad=True)
    compiled(x, w).backward()
    ref = w.detach().clone().requires_grad_()
    _f(x, ref).backward()
    torch.testing.assert_close(w.grad, ref.grad, rtol=0, atol=0)  # the round trip is exact
    (plan,) = plans
    assert [n for _, n in plan["moved"]] == [8 * 64 * 4] and all(n < 1024 for _, n in plan["kept"])
    fw_out = next(n for n in graphs["fw"].graph.nodes if n.op == "output").args[0]
    assert sum(getattr(o, "target", None) is OFFLOAD for o in fw_out) == 1  # the saved slot is the host copy
    reloads = [n for n in graphs["bw"].graph.nodes if n.target is RELOAD]
    assert len(reloads) == 1 and reloads[0].args[0].name == plan["moved"][0][0]
    assert (units.act_offloads, units.act_reloads, units.act_host_bytes) == (1, 1, 0)


def test_optimizer_states_go_to_host_and_come_back_for_the_step() -> None:
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(2)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, ref_opt = torch.optim.AdamW(ps, lr=0.1), torch.optim.AdamW(ref, lr=0.1)
    off = OptStateOffload(opt)
    for step in range(3):
        off.offload()  # head of the forward
        if step:
            states = [v for st in opt.state.values() for k, v in st.items() if k != "step"]
            assert off.on_host and len(states) == 4 and all(any(v is h for h in off.host.values()) for v in states)
        for p, r in zip(ps, ref):
            p.grad = torch.full_like(p, step + 1.0)
            r.grad = torch.full_like(r, step + 1.0)
        opt.step()  # the pre-hook reloads first
        ref_opt.step()
        assert not off.on_host and not any(v is h for st in opt.state.values() for v in st.values()
                                           for h in off.host.values())
    assert (off.offloads, off.reloads) == (2, 2)  # nothing to move before the first step
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p, r, rtol=0, atol=0)
    off.close()


def _refusal(compile_cfg: dict[str, Any], stage: int = 3, **zero: Any) -> str:
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                       "zero_optimization": {"stage": stage, **zero}, "compile": {"deepcompile": True, **compile_cfg}})
    return _plan_refusal(cfg)


def _plan_refusal(cfg: Any) -> str:
    try:
        plan_training(cfg, ModelFacts(optimizer=OptimizerFacts(client=False)))
    except ConfigError as e:
        return f"{e.key}: {e}"
    return "no error"


def test_offload_combinations_refused_as_deepspeed_does() -> None:
    for key in ("offload_opt_states", "offload_parameters", "offload_activation"):
        assert _refusal({key: True}) == "no error"
        assert _refusal({key: True}, stage=2).startswith("compile:") and "ZeRO-3" in _refusal({key: True}, stage=2)
    assert "both manage the same optimizer state" in _refusal({"offload_opt_states": True},
                                                              offload_optimizer={"device": "cpu"})
    assert _refusal({"offload_parameters": True}, offload_param={"device": "cpu"}) == "no error"
    assert _refusal({"offload_activation": True, "offload_opt_states": True}).startswith("compile.offload_activation")
    assert _refusal({"offload_parameters": True, "offload_opt_states": True}).startswith("compile.offload_parameters")
    with pytest.warns(UserWarning, match=r"compile\.offload_opt_states has no effect without compile\.deepcompile"):
        load_config({"train_micro_batch_size_per_gpu": 1, "compile": {"offload_opt_states": True}})


def test_autoep_regional_compile_refusals() -> None:
    from zerospeed.runtime.compile import compile_autoep_regions

    def cfg(stage: int, deep: bool = False, **zero: Any) -> Any:
        return load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                            "zero_optimization": {"stage": stage, **zero},
                            "compile": {"autoep_non_moe": True, "deepcompile": deep}})

    assert _plan_refusal(cfg(1)) == "no error"
    assert "cannot be combined with DeepCompile" in _plan_refusal(cfg(1, deep=True))
    assert "ZeRO stage 3" in _plan_refusal(cfg(3))
    assert "ZeRO offload" in _plan_refusal(cfg(2, offload_optimizer={"device": "cpu"}))
    with pytest.raises(ValueError, match="at least one AutoEP MoE layer"):
        compile_autoep_regions(torch.nn.Linear(2, 2), "eager", {}, None, False)
    with pytest.raises(ValueError, match="fullgraph=False"):
        compile_autoep_regions(torch.nn.Linear(2, 2), "eager", {"fullgraph": True}, None, False)
