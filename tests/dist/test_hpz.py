"""ZeRO++ hpZ (``zero_hpz_partition_size``) on 2 simulated nodes x 2 ranks (world 4).

Each cut parameter keeps a secondary partition over its node's 2 ranks: backward's all-gathers then run
on the intra-node groups {0,1} and {2,3} only (counted per group by the comms logger), the first forward
after each optimizer step gathers over all 4 ranks (the secondary is stale after the step), and training
equals plain ZeRO-3 (the secondary is an exact slice of the fp32 value)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .zero3_fixtures import make_model, micro_batch

NODES = {(0, 1), (2, 3)}
WORLD = (0, 1, 2, 3)


def run(zero: dict[str, Any], steps: int) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm
    from zerospeed.zero import full_state_dict

    rank, world = comm.get_rank(), comm.get_world_size()
    model = make_model()
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 200, "stage3_max_reuse_distance": 0, **zero}}
    engine, opt, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses, fwd, bwd = [], [], []
    for step in range(steps):
        x, y = micro_batch(step, 0, rank, world, 2, 1)
        comm.COMMS_LOGGER.reset()
        loss = engine(x, y)
        fwd.append(dict(comm.COMMS_LOGGER.snapshot()["all_gather"].groups))
        comm.COMMS_LOGGER.reset()
        engine.backward(loss)
        bwd.append(dict(comm.COMMS_LOGGER.snapshot()["all_gather"].groups))
        engine.step()
        total = loss.detach().clone()
        comm.all_reduce(total)
        losses.append(float(total) / world)
    with torch.no_grad():  # gathers (int8 under qwZ) and, on release, cuts secondaries from what it gathered
        engine(*micro_batch(steps, 0, rank, world, 2, 1))
    fp32 = full_state_dict(model, optimizer=opt, fp32=True, rank0_only=False)
    exported = full_state_dict(model, rank0_only=False)  # an exact gather: never from a dequantised secondary
    return {"losses": losses, "fwd": fwd, "bwd": bwd, "fp32": fp32, "exported": exported,
            "param_bytes": engine.zero3.param_bytes()}


def test_backward_gathers_stay_in_the_node_and_training_equals_plain_zero3() -> None:
    plain = run_distributed(run, 4, {}, 3, timeout=120)
    hpz = run_distributed(run, 4, {"zero_hpz_partition_size": 2}, 3, timeout=120)
    for p, h in zip(plain, hpz):
        torch.testing.assert_close(h["losses"], p["losses"], rtol=1e-6, atol=0)
        for k in p["fp32"]:
            torch.testing.assert_close(h["fp32"][k], p["fp32"][k], rtol=1e-6, atol=1e-7)
        for step in range(3):
            assert set(p["bwd"][step]) == {WORLD}  # plain: backward gathers over all ranks
            assert set(h["bwd"][step]) <= NODES and h["bwd"][step], h["bwd"][step]  # hpZ: never across nodes
            # same bytes per gather (the full value arrives either way), only the group differs
            assert sum(h["bwd"][step].values()) == sum(p["bwd"][step].values())
        for step in range(1, 3):
            assert WORLD in h["fwd"][step]  # after a step the trainable weights come from the primary partition
        # kept between uses: the secondary partition, half of each cut parameter (fp32), on top of the primary
        half = sum((q.numel() + 1) // 2 for q in make_model().parameters())
        assert h["param_bytes"] - p["param_bytes"] == 4 * half


def _bad(zero: dict[str, Any]) -> None:
    import zerospeed

    model = make_model()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, **zero}}
    zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)


def test_partition_size_must_divide_the_world() -> None:
    with pytest.raises(Exception, match="zero_hpz_partition_size 3 must divide"):
        run_distributed(_bad, 2, {"zero_hpz_partition_size": 3}, timeout=60)


def test_with_quantized_weights_the_node_gathers_move_int8() -> None:
    plain = run_distributed(run, 4, {}, 3, timeout=120)[0]
    both = run_distributed(run, 4, {"zero_hpz_partition_size": 2, "zero_quantized_weights": True}, 3, timeout=120)[0]
    for step in range(3):
        assert set(both["bwd"][step]) <= NODES
        # int8 values (a quarter of fp32) plus one fp32 scale per block, padded to multiples of 8
        assert sum(both["bwd"][step].values()) <= 0.4 * sum(plain["bwd"][step].values())
    for k, v in both["fp32"].items():
        assert torch.equal(both["exported"][k], v), k
    assert both["losses"] != plain["losses"]
    for a, b in zip(both["losses"], plain["losses"]):
        assert abs(a - b) <= 0.02 * b
