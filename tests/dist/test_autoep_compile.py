"""``compile.autoep_non_moe`` (DeepSpeed's AutoEP regional compile) on a tiny HF Mixtral at ep 2 (world 2), ZeRO-1,
``aot_eager``: each decoder layer compiles while its AutoEP MoE block (router, all-to-alls, expert compute) runs
eagerly; the losses and parameters equal one process's (rtol 1e-5), as eager AutoEP's do (tests/dist/test_autoep.py).
"""

from __future__ import annotations

import pytest
import torch

import zerospeed
from zerospeed import comm
from zerospeed.testing import run_distributed

from .autoep_fixtures import check_state, engine_config, local_state, reference, tiny_moe, train_steps

STEPS, MB, LR = 2, 2, 0.2


def _train() -> tuple:
    from torch._dynamo.utils import counters

    rank, world = comm.get_rank(), comm.get_world_size()
    model = tiny_moe("mixtral")
    cfg = {**engine_config(1, 2, MB, world, LR), "compile": {"autoep_non_moe": True}}
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    torch._dynamo.reset()
    counters.clear()
    engine.compile(backend="aot_eager")
    traced: dict[str, list[bool]] = {"block": [], "attention": []}  # is_compiling() at each call
    for layer in model.model.layers:
        # the block's own hooks run in the compiled caller (module __call__); what its forward calls runs eagerly
        layer.mlp.experts.register_forward_pre_hook(
            lambda m, a: traced["block"].append(torch.compiler.is_compiling()))
        layer.self_attn.register_forward_pre_hook(
            lambda m, a: traced["attention"].append(torch.compiler.is_compiling()))
    losses = train_steps(engine, STEPS, rank, MB)
    regions = [n for n, m in model.named_modules() if m._compiled_call_impl is not None]
    with zerospeed.zero.GatheredParameters(list(model.parameters())):
        state = local_state(model)
    graphs = int(counters["stats"]["unique_graphs"])
    return losses, state, model.model.layers[0].mlp.experts.global_expert_ids()[0], regions, traced, graphs


def test_autoep_non_moe_compiles_the_layers_around_eager_moe_blocks_and_equals_one_process() -> None:
    results = run_distributed(_train, 2, timeout=300)
    ref_losses, ref = reference("mixtral", STEPS, 2, MB, LR)
    for rank, (losses, state, first, regions, traced, graphs) in enumerate(results):
        assert losses == pytest.approx([r[rank] for r in ref_losses], rel=1e-5)
        check_state(state, ref, first)
        assert regions == ["model.layers.0", "model.layers.1"], regions  # the MoE blocks' parents
        assert traced["block"] == [False] * (2 * STEPS), traced  # eager at every call, never traced
        assert traced["attention"] and all(traced["attention"]), traced  # inside the compiled region
        assert graphs >= 2, graphs
