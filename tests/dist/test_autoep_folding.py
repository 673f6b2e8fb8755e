"""AutoEP + AutoTP ("parallel folding") on a tiny HF Mixtral: tensor-parallel pairs of ranks serve tp 2 for the
attention and ep 2 for the experts. World 2 (one data replica, ZeRO 0) and world 4 (two replicas, ZeRO-2, clipping):
three SGD steps equal one process within rtol 1e-5 (fp32), load-balancing loss included: losses, every gathered
weight (tensor-split attention, router, norms) and each rank's experts."""

from __future__ import annotations

import pytest

import zerospeed
from zerospeed import comm
from zerospeed.parallel.tensor.export import full_state_dict
from zerospeed.testing import run_distributed

from .autoep_fixtures import batch, check_state, engine_config, loss_of, reference, tiny_moe

STEPS, MB, LR, TP = 3, 2, 0.2, 2


def _train(stage: int, clip: float) -> tuple:
    replicas, replica = comm.get_world_size() // TP, comm.get_rank() // TP  # tensor peers are adjacent ranks
    model = tiny_moe("mixtral")
    cfg = engine_config(stage, 2, MB, replicas, LR)
    cfg["tensor_parallel"] = {"autotp_size": TP}
    cfg["gradient_clipping"] = clip
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    experts = model.model.layers[0].mlp.experts
    assert experts.fold is not None and experts.gate_up_proj.shape[0] == 2
    assert model.model.layers[0].self_attn.q_proj.weight.shape[0] == 16 // TP  # attention is split too
    losses = []
    for step in range(STEPS):
        loss = loss_of(engine, *batch(step, replica, MB))  # the tensor peers read the same batch
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses, full_state_dict(model), experts.global_expert_ids()[0], replica


@pytest.mark.parametrize("world,stage,clip", [(2, 0, 0.0), (4, 2, 0.5)])
def test_folding_tp2_ep2_matches_one_process(world: int, stage: int, clip: float) -> None:
    results = run_distributed(_train, world, stage, clip, timeout=240)
    ref_losses, ref = reference("mixtral", STEPS, world // TP, MB, LR, clip=clip)
    for losses, state, first, replica in results:
        assert losses == pytest.approx([r[replica] for r in ref_losses], rel=1e-5)
        check_state(state, ref, first, atol=2e-6)  # world 4: tensor and data all-reduces reorder the sums
