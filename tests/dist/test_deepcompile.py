"""DeepCompile (``compile.deepcompile: true``): ZeRO-3's gathers and gradient hand-offs inside the compiled graph.

One distributed run (world 2, the demo GPT at a tiny size, gradient accumulation 2) trains eager ZeRO-3,
DeepCompile ZeRO-3 and DeepCompile ZeRO-2 (aot_eager: the point is the graph, not inductor's C++), and
checks them several ways against each other and a one-process reference.
``python tests/dist/test_deepcompile.py --world 4`` runs the same checks at world 4 (outside ``make test``).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import zerospeed
from zerospeed.testing import run_distributed

STEPS, MB, GAS, LR, SEQ = 2, 2, 2, 1e-2, 8


class _Scope:
    """State a model changes inside its forward and restores (as Hugging Face's ``kernels`` does around every
    Llama attention): the first block's hooks enter and leave it, and mark it seen."""

    depth = 0
    seen = False

    @classmethod
    def enter(cls, module: Any, args: Any) -> None:
        cls.depth += 1
        cls.seen = True

    @classmethod
    def leave(cls, module: Any, args: Any, output: Any) -> None:
        cls.depth -= 1


def _gpt() -> torch.nn.Module:
    from zerospeed.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(block_size=SEQ, vocab_size=32, n_layer=2, n_head=2, n_embd=16, dropout=0.0), seed=0)


def _batch(step: int, micro: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, 32, (MB * GAS * world, SEQ), generator=g)
    lo = (micro * world + rank) * MB
    return idx[lo:lo + MB]


def _config(stage: int, deep: bool) -> dict[str, Any]:
    compile_cfg: dict[str, Any] = {"deepcompile": deep}
    if deep and stage == 3:  # DeepSpeed's keys, read: the op log, synchronisation points (no-ops on CPU), and
        # every saved activation freed after its last use in backward (free_activation, threshold 0)
        compile_cfg.update(debug_log=True, passes=["z3"], sync_before_allgather=True, sync_after_reduce=True,
                           free_activation=True, free_activation_threshold=0)
    return {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            # LayerNorms (16 elements a tensor) stay whole, the rest is partitioned; selective gather keeps
            # the last unit (the last MLP projection, 1040 elements)
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 16, "reduce_bucket_size": 300,
                                  "stage3_max_reuse_distance": 1100, "stage3_prefetch_bucket_size": 2000},
            "compile": compile_cfg}


def _train(stage: int, deep: bool, compiled: bool) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    from zerospeed import comm
    from zerospeed.zero import full_state_dict

    world, rank = comm.get_world_size(), comm.get_rank()
    model = _gpt()
    # DeepCompile's own checkpoint around the model must not make dynamo refuse a side effect (graph_forward.py)
    _Scope.seen = False
    model.blocks[0].register_forward_pre_hook(_Scope.enter)
    model.blocks[0].register_forward_hook(_Scope.leave)
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage, deep))
    torch._dynamo.reset()
    counters.clear()
    if compiled:
        engine.compile(backend="aot_eager")
    out: dict[str, Any] = {"losses": [], "frames": [], "breaks": []}
    for step in range(STEPS):
        total = 0.0
        for micro in range(GAS):
            idx = _batch(step, micro, rank, world)
            _, loss = engine(idx, idx)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach()) / GAS
        out["frames"].append(int(counters["stats"]["unique_graphs"]))
        out["breaks"].append(int(sum(counters["graph_break"].values())))
        summed = torch.tensor(total)
        comm.all_reduce(summed)
        out["losses"].append(float(summed) / world)
    out["scope"] = (_Scope.depth, _Scope.seen)
    graph = engine.deepcompiled.graph if engine.deepcompiled is not None else None
    out["gathers"] = None if graph is None else (graph.gathers, graph.reduces, len(graph.units), graph.prefetches,
                                                   graph.prefetch_calls)
    out["schedule"] = None if graph is None else (graph.schedule_checks, graph.covered_ops)
    out["kept"] = None if graph is None else sorted(engine.deepcompiled.kept)
    out["freed"] = None if graph is None else sum(map(len, engine.deepcompiled.freed))
    out["log"] = None if graph is None else graph.log[:graph.log.index(("reduce", 0)) + 1]  # the first micro-step
    out["state"] = {k: v.float().clone() for k, v in full_state_dict(model, group=engine.dp_group).items()}
    return out


def _all() -> dict[str, Any]:
    return {"eager3": _train(3, False, False), "deep3": _train(3, True, True), "deep2": _train(2, True, True)}


def _reference(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for micro in range(GAS):
            idx = torch.cat([_batch(step, micro, r, world) for r in range(world)])
            _, loss = model(idx, idx)
            (loss / GAS).backward()
            total += float(loss.detach()) / GAS
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_deepcompile_zero3_has_no_graph_break_and_equals_eager_and_one_process() -> None:
    check(2)


def check(world: int) -> None:
    result = run_distributed(_all, world, timeout=600)[0]
    ref_losses, ref_state = _reference(world)
    eager, deep3, deep2 = result["eager3"], result["deep3"], result["deep2"]
    for name, run in (("deep3", deep3), ("deep2", deep2)):
        assert run["breaks"] == [0] * STEPS, (name, run["breaks"])  # dynamo's own graph-break counter
        assert run["frames"] == [1] * STEPS, (name, run["frames"])  # one graph, no recompile after step 1
        assert run["scope"] == eager["scope"] == (0, True), (name, run["scope"], eager["scope"])
        torch.testing.assert_close(run["losses"], ref_losses, rtol=1e-5, atol=1e-6, msg=name)
        for key, ref in ref_state.items():
            # atol 2e-5: the attention's key bias has an analytically zero gradient, so Adam normalises float noise
            torch.testing.assert_close(run["state"][key], ref, rtol=1e-5, atol=2e-5, msg=f"{name} {key}")
            torch.testing.assert_close(run["state"][key], eager["state"][key], rtol=1e-6, atol=1e-7, msg=f"{name} {key}")
    torch.testing.assert_close(deep3["losses"], eager["losses"], rtol=1e-6, atol=1e-7)
    gathers, reduces, units, prefetches, prefetch_calls = deep3["gathers"]
    micro_steps = STEPS * GAS
    # 10 modules' units and the tied head's, which holds the final norm (persistent parameters join the unit of
    # the next module: runtime/deepcompile.with_persistent); selective gather keeps the last MLP projection and it
    assert units == 11 and deep3["kept"] == [units - 2, units - 1]
    assert deep3["freed"] > 10, deep3["freed"]  # free_activation: the backward frees the saved activations
    # forward: every unit; backward: again, but the kept ones and the position table (embedding backward needs
    # no weight)
    assert gathers == micro_steps * (units + units - 3), gathers
    log = deep3["log"]
    per_micro_step = sum(1 for op, _ in log if op == "reduce")
    assert reduces == per_micro_step * micro_steps and per_micro_step > units, (reduces, units)  # one per gradient
    forward = log[:2 * units - 1]  # a gather per unit, a prefetch per unit but the first
    backward = log[len(forward):]
    assert [u for op, u in forward if op == "gather"] == list(range(units))
    for u in range(1, units):  # prefetched before the previous unit's gather, at least
        assert forward.index(("prefetch", u)) < forward.index(("gather", u - 1)), u
    assert prefetches == micro_steps * sum(1 for op, _ in log if op == "prefetch")
    # a pass's first window is one launch (one collective and one lockstep check), not one per unit
    assert 0 < prefetch_calls < prefetches - micro_steps, (prefetch_calls, prefetches)
    # one lockstep exchange per compiled graph call (forward and backward of each micro-step) stands for all
    # of its gathers and prefetches (graph_passes.check_schedule), at world > 1
    checks, covered = deep3["schedule"]
    assert checks == (2 * micro_steps if world > 1 else 0), checks
    assert covered == (gathers + prefetch_calls if world > 1 else 0), (covered, gathers, prefetch_calls)
    assert ("gather", units - 1) not in backward and ("gather", units - 2) not in backward and ("gather", 1) not in backward
    # reduce-scatters as soon as a gradient is final: interleaved with backward's gathers, not all at the end
    assert backward.index(("reduce", units - 1)) < backward.index(("gather", 2)) < backward.index(("reduce", 0))
    order = [u for op, u in backward if op == "reduce"]
    assert [u for i, u in enumerate(order) if i == 0 or order[i - 1] != u] == list(range(units - 1, -1, -1))


def test_private_compiler_surface_is_where_deepcompile_expects_it() -> None:
    """Every private name DeepCompile uses (docs/compile.md lists them), pinned so that a PyTorch upgrade that
    moves one fails here. In this file because the harness's warm-up has loaded dynamo (no import cost)."""
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch.nn.utils.stateless import _reparametrize_module
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    assert callable(aot_autograd) and callable(create_selective_checkpoint_contexts)
    assert dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint is False  # graph_forward patches it per call
    # graph_free.ListArgsCodeGen overrides torch.fx.CodeGen.gen_fn_def (public, but its signature is what we rely on)
    import inspect

    assert list(inspect.signature(torch.fx.CodeGen.gen_fn_def).parameters)[:3] == ["self", "free_vars",
                                                                                  "maybe_return_annotation"]
    assert CustomGraphPass.__abstractmethods__ == frozenset({"__call__", "uuid"})
    assert {"MUST_SAVE", "MUST_RECOMPUTE", "PREFER_SAVE", "PREFER_RECOMPUTE"} <= set(CheckpointPolicy.__members__)
    assert torch.ops.aten.t.default.is_view and not torch.ops.aten.mm.default.is_view
    assert hasattr(torch.nn.Module, "_call_impl") and torch.nn.Linear(1, 1)._compiled_call_impl is None
    lin = torch.nn.Linear(2, 2)
    other = torch.nn.Linear(2, 2)
    lin.extra = other  # type: ignore[assignment]
    other.weight = lin.weight  # tied: both names swapped to the same value
    w = torch.ones(2, 2)
    with _reparametrize_module(lin, {"weight": w, "extra.weight": w}):
        assert lin.weight is w and other.weight is w
    assert lin.weight is other.weight and lin.weight is not w


if __name__ == "__main__":
    check(int(sys.argv[sys.argv.index("--world") + 1]) if "--world" in sys.argv else 2)
    print("DeepCompile demo GPT parity: ok")


def test_inductor_cache_key_names_the_pass_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor caches compiled code on disk by the custom pass's uuid: a changed pass or op schema (PASS_VERSION)
    must change it, or a cache written by an older zerospeed would be reused. (In this file: it imports inductor,
    which the harness's warm-up has loaded here already.)"""
    from zerospeed.config.compile import CompileConfig
    from zerospeed.runtime import deepcompile

    def key() -> str:
        _, options = deepcompile._pass_backend("inductor", ("zero3_compile", "prefetch"), [5, 5], 5,
                                               CompileConfig(deepcompile=True), None)  # type: ignore[arg-type]
        return options["options"]["post_grad_custom_post_pass"].uuid()

    now = key()
    assert now == key()  # the same passes and sizes: the cache is reused
    monkeypatch.setattr(deepcompile, "PASS_VERSION", deepcompile.PASS_VERSION + 1)
    assert key() != now
