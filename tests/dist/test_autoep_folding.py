"""AutoEP + AutoTP ("parallel folding"): tensor-parallel pairs of ranks serve tp 2 for the attention and ep 2 for
the experts. World 2 (one data replica): tiny Qwen2-MoE at ZeRO 0 (its shared expert split by AutoTP), tiny Mixtral
at ZeRO-1 with score_apply "pre", route_scale and the route check; world 4 (two replicas): Mixtral at ZeRO-2 with
clipping. Three SGD steps equal one process within rtol 1e-5 (fp32), load-balancing loss included: losses, every
gathered weight (tensor-split attention, router, norms) and each rank's experts. Also: a folded Adam checkpoint
resumes in one plain process, and tensor ranks that route differently are named."""

from __future__ import annotations

import pytest

import zerospeed
from zerospeed import comm
from zerospeed.parallel.tensor.export import full_state_dict
from zerospeed.testing import run_distributed

from .autoep_fixtures import batch, check_state, engine_config, loss_of, reference, tiny_moe, train_steps

STEPS, MB, LR, TP = 3, 2, 0.2, 2


def _train(stage: int, clip: float, routing: dict, tp: int = TP, ep: int = 2, adam: bool = False,
           steps: int = STEPS, save: str = "", load: str = "", family: str = "mixtral") -> tuple:
    replicas, replica = comm.get_world_size() // tp, comm.get_rank() // tp  # tensor peers are adjacent ranks
    model = tiny_moe(family)
    cfg = engine_config(stage, ep, MB, replicas, 0.01 if adam else LR, adam)
    cfg["gradient_clipping"] = clip
    cfg["expert_parallel"].update(routing)
    cfg["checkpoint"] = {"load_universal": bool(load)}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    experts = model.model.layers[0].mlp.experts
    assert (experts.fold is not None) == (tp > 1) and experts.gate_up_proj.shape[0] == 4 // ep
    assert model.model.layers[0].self_attn.q_proj.weight.shape[0] == 16 // tp  # attention is split too
    losses = train_steps(engine, steps, replica, MB, load)  # the tensor peers read the same batch
    if save:
        engine.save_checkpoint(save, tag="t")
        engine.save_16bit_model(save, "model.safetensors")
    return losses, full_state_dict(model), experts.global_expert_ids()[0], replica


@pytest.mark.parametrize("family,world,stage,clip,routing", [
    ("qwen2_moe", 2, 0, 0.0, {}), ("mixtral", 4, 2, 0.5, {}),
    ("mixtral", 2, 1, 0.0, {"score_apply": "pre", "route_scale": 1.5, "validate_folding_routing": True})])
def test_folding_tp2_ep2_matches_one_process(family: str, world: int, stage: int, clip: float, routing: dict) -> None:
    results = run_distributed(_train, world, stage, clip, routing, family=family, timeout=240)
    ref_losses, ref = reference(family, STEPS, world // TP, MB, LR, clip=clip, routing=routing)
    for losses, state, first, replica in results:
        assert losses == pytest.approx([r[replica] for r in ref_losses], rel=1e-5)
        check_state(state, ref, first, atol=2e-6)  # world 4: tensor and data all-reduces reorder the sums


def test_folded_checkpoint_loads_in_one_process_with_adam_state(tmp_path) -> None:
    """Saved folded (tp 2, ep 2, ZeRO-1) after 2 Adam steps, loaded by one plain process (no tp, ep 1): steps 3-4
    equal the uninterrupted run (split attention reassembled; each rank wrote its own experts and their moments);
    save_16bit_model writes the whole HF model (one file, by rank 0)."""
    run_distributed(_train, 2, 1, 0.0, {}, TP, 2, True, 2, str(tmp_path), timeout=180)
    from safetensors.torch import load_file

    whole = load_file(str(tmp_path / "model.safetensors"))  # save_16bit_model: attention joined, every expert
    _, after_two = reference("mixtral", 2, 1, MB, 0.01, adam=True)
    assert set(whole) == {n for n, _ in after_two.named_parameters()}
    check_state(whole, after_two, 0, atol=2e-6)
    (losses, *_), = run_distributed(_train, 1, 1, 0.0, {}, 1, 1, True, 2, "", str(tmp_path), timeout=180)
    ref_losses, _ = reference("mixtral", 4, 1, MB, 0.01, adam=True)
    assert losses == pytest.approx([r[0] for r in ref_losses[2:]], rel=1e-5)


def _diverged() -> None:
    model = tiny_moe("mixtral")
    cfg = engine_config(0, 2, MB, 1, LR)
    cfg["tensor_parallel"] = {"autotp_size": TP}
    cfg["expert_parallel"]["validate_folding_routing"] = True
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    loss_of(engine, *batch(0, comm.get_rank(), MB))  # tensor peers fed different tokens: a user error


def test_validate_folding_routing_names_tensor_ranks_that_route_differently() -> None:
    with pytest.raises(Exception, match=r"model.layers.0.mlp\): the tensor-parallel ranks routed differently"):
        run_distributed(_diverged, 2, timeout=120)
