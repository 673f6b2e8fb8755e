"""ZeRO-3 extras at world 2 against one process: leaf modules (MoE blocks gathered whole, so ranks that route
to different experts stay in step), automatic leaves by granularity, and the fetch modes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .zero3_extras_fixtures import E, make_model, micro_batch, reference, train, train_each

STEPS, WORLD, MB = 2, 2, 2


def _close(got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)


def _runs(runs: list[dict[str, Any]], world: int = WORLD, steps: int = STEPS) -> list[list[dict[str, Any]]]:
    """Each run's results, per rank: ``out[run][rank]``."""
    per_rank = run_distributed(train_each, world, runs, steps, timeout=60 + 30 * len(runs))
    return [[per_rank[r][i] for r in range(world)] for i in range(len(runs))]


LEAF = {"leaf_module": {"names": ["block"]}}
# Every world-2 run of this file, trained once in one set of forked ranks (the ``w2`` fixture).
WORLD2: dict[str, dict[str, Any]] = {
    "leaf_api": {"zero": {}, "leaves": ("LoopMoeBlock",)},  # set_z3_leaf_modules
    "leaf": {"zero": LEAF},
    "leaf_class": {"zero": {"leaf_module": {"classes": "tests.dist.zero3_extras_fixtures.LoopMoeBlock"}}},
    # granularity (DeepSpeed's rule): root 2256 // 18 = 125, block 1152 // 14 = 82, each expert 280 // 3 = 93
    "granularity": {"zero": {"stage3_module_granularity_threshold": 90}},
    "hf": {"zero": {}, "hf": True},
    "by_reduce": {"zero": {**LEAF, "stage3_use_all_reduce_for_fetch_params": True}},
    "sequential": {"zero": {**LEAF, "stage3_allgather_sequential": True}},
    "mics1": {"zero": {**LEAF, "mics_shard_size": 1}},
    "mics2": {"zero": {**LEAF, "mics_shard_size": 2}},
    "mics2_levels": {"zero": {**LEAF, "mics_shard_size": 2, "mics_hierarchical_params_gather": True},
                     "ranks_per_node": 1},
    "sane": {"zero": {**LEAF, "enable_sanity_checks": True}, "modify_gathered": True,
             "root": {"disable_allgather": True}},
    "quiet": {"zero": LEAF, "modify_gathered": True},
    "legacy": {"zero": {"stage": 1, "legacy_stage1": True}},
    "apply": {"zero": {**LEAF, "override_module_apply": True}, "in_init": True},
    "apply_off": {"zero": {**LEAF, "override_module_apply": False}, "in_init": True},
}


@pytest.fixture(scope="module")
def w2() -> dict[str, list[dict[str, Any]]]:
    pytest.importorskip("transformers")
    return dict(zip(WORLD2, _runs(list(WORLD2.values()))))


def test_a_leaf_moe_block_is_one_unit_and_trains_as_one_process(w2: dict[str, list[dict[str, Any]]]) -> None:
    # the fixture's ranks route to different experts (so per-expert gathers would diverge)
    experts = [{int(t) % E for t in micro_batch(s, r, WORLD, MB)[0].reshape(-1)} for s in range(STEPS) for r in (0, 1)]
    assert all(a.isdisjoint(b) for a, b in zip(experts[::2], experts[1::2]))
    want = reference(STEPS, WORLD, MB)
    for run in (w2["leaf_api"], w2["leaf"], w2["leaf_class"], w2["granularity"]):
        for r in run:
            _close(r["losses"], want)
            assert "block" in r["units"] and not any(u.startswith("block.") for u in r["units"]), r["units"]


def test_without_a_leaf_ranks_that_route_differently_are_named_not_hung() -> None:
    with pytest.raises(Exception, match="ranks diverged"):
        run_distributed(train_each, WORLD, [{"zero": {}}], 1, timeout=60)


def test_hf_mixtral_block_is_a_leaf_by_default(w2: dict[str, list[dict[str, Any]]]) -> None:
    want = reference(STEPS, WORLD, MB, hf=True)
    for r in w2["hf"]:
        assert "block.moe" in r["units"] and not any(u.startswith("block.moe.") for u in r["units"]), r["units"]
        _close(r["losses"], want)


def test_fetch_by_all_reduce_and_sequential_gathers_train_alike(w2: dict[str, list[dict[str, Any]]]) -> None:
    want = reference(STEPS, WORLD, MB)
    plain, by_reduce, sequential = w2["leaf"], w2["by_reduce"], w2["sequential"]
    for run in (plain, by_reduce, sequential):
        for r in run:
            _close(r["losses"], want)
    p, a, s = plain[0]["ops"][-1], by_reduce[0]["ops"][-1], sequential[0]["ops"][-1]
    # each gather of several parameters became one all-reduce (a gather of one stays an all-gather, as in DeepSpeed)
    assert a["all_reduce"] - p["all_reduce"] == p["all_gather"] - a["all_gather"] > 0, (p, a)
    assert s["all_gather"] >= p["all_gather"] + 17, (p, s)  # the block's 18 parameters: one gather each


def test_mics_shards_within_groups_and_trains_as_one_process(w2: dict[str, list[dict[str, Any]]],
                                                             tmp_path: Any) -> None:
    want2, want4 = reference(STEPS, 2, MB), reference(3, 4, MB)  # 3 steps: LoCo's feedback shows from the third
    whole, one, two, levels = w2["leaf"], w2["mics1"], w2["mics2"], w2["mics2_levels"]
    for run in (one, two, levels):
        for r in run:
            _close(r["losses"], want2)
    numel = sum(p.numel() for p in make_model().parameters())
    assert one[0]["units"] == [] and one[0]["param_bytes"] == 4 * numel  # shard size 1: each rank holds it whole
    assert two[0]["units"] == whole[0]["units"]
    assert "inter:all_gather" in levels[0]["groups"] and "inter:all_gather" not in two[0]["groups"]
    qgz = {**LEAF, "zero_quantized_gradients": True}  # LoCo rides along in this world-4 fork (see below)
    # ``leaf4``: a leaf at world 4 (each rank its own expert): its buckets are reduced after backward, else their
    # reduce-scatters interleave differently per rank with the gathers on the same group (a hang, before)
    leaf4, replicated, spanning, int4, loco = _runs([
        {"zero": LEAF},
        {"zero": {**LEAF, "mics_shard_size": 2}, "save_to": str(tmp_path)},
        {"zero": {**LEAF, "mics_shard_size": 4, "mics_hierarchical_params_gather": True}, "ranks_per_node": 2},
        {"zero": qgz, "ranks_per_node": 2},
        {"zero": {**qgz, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}, "ranks_per_node": 2}], world=4,
        steps=3)
    _loco_checks(int4, loco, want4)
    for run in (leaf4, replicated, spanning):
        for r in run:
            _close(r["losses"], want4)
    for rank, r in enumerate(replicated):  # gathers stay in the shard group; gradients cross the replicas
        shard = (0, 1) if rank < 2 else (2, 3)
        assert r["groups"]["all_gather"] == [shard], r["groups"]
        assert ((rank % 2, rank % 2 + 2)) in r["groups"]["all_reduce"], r["groups"]
    assert "NotSupportedYetError" in replicated[0]["refused"] and "save_checkpoint with MiCS" in replicated[0]["refused"]
    assert spanning[0]["groups"]["inter:all_gather"] == [(0, 2)] and spanning[0]["groups"]["intra:all_gather"] == [(0, 1)]


def _loco_checks(int4: list[dict[str, Any]], loco: list[dict[str, Any]], want: list[float]) -> None:
    """zeropp_loco_param (world 4 = 2 nodes x 2): qgZ with LoCo trains within int4's tolerance of one process,
    and its error feedback changes what is sent (the losses after the first step differ from plain qgZ's)."""
    for r in loco:
        torch.testing.assert_close(r["losses"], want, rtol=0.02, atol=0)
    assert loco[0]["losses"][0] == int4[0]["losses"][0] and loco[0]["losses"][1:] != int4[0]["losses"][1:]
    assert loco[0]["groups"]["inter:all_to_all"] == int4[0]["groups"]["inter:all_to_all"]


def test_loco_error_feedback_sends_what_quantisation_dropped() -> None:
    """One simulated rank, the same input reduced 40 times: with LoCo the outputs average to the input."""
    from types import SimpleNamespace

    from zerospeed import comm
    from zerospeed.comm.hierarchy import NodeLayout

    h = SimpleNamespace(layout=NodeLayout(1, 1), intra=None, inter=None)
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    out = torch.empty(64)
    comm.quantized_reduce_scatter(out, x, h, 16)
    plain = (out - x).abs().mean()
    errors = (torch.zeros(64), torch.zeros(64))
    total = torch.zeros(64)
    for _ in range(40):
        comm.quantized_reduce_scatter(out, x, h, 16, errors, err_beta=0.8)
        total += out
    assert (total / 40 - x).abs().mean() < 0.25 * plain, ((total / 40 - x).abs().mean(), plain)


def test_sanity_checks_legacy_stage1_and_apply_under_init_train_as_one_process(
        w2: dict[str, list[dict[str, Any]]]) -> None:
    want, want_reinit = reference(STEPS, WORLD, MB), reference(STEPS, WORLD, MB, reinit=True)
    sane, quiet, legacy, applied, plain_apply = (w2[k] for k in ("sane", "quiet", "legacy", "apply", "apply_off"))
    for run in (sane, quiet, legacy):
        for r in run:
            _close(r["losses"], want)
    for run in (applied, plain_apply):
        for r in run:
            _close(r["losses"], want_reinit)
    assert [r["refused"] for r in sane] == ["ModifiedWithoutModifierError"] * WORLD
    assert [r["refused"] for r in quiet] == [None] * WORLD  # off (DeepSpeed's default): no check
    assert legacy[0]["units"] == []  # stage 1: nothing gathered



def _graphs() -> str:
    from zerospeed.config import ConfigError

    try:
        train({}, 1, root={"graph_harvesting": True})
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def test_graph_harvesting_off_cuda_is_refused_naming_the_device() -> None:
    assert "need a CUDA device; this engine runs on 'cpu'" in run_distributed(_graphs, 1, timeout=60)[0]
