"""Data efficiency in the engine (world 2, Gloo): the sequence-length curriculum trains like a single-process
reference that truncates the same way; PLD and random-LTD schedules advance per step; checkpoints carry them."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from zerospeed.testing import run_distributed

import zerospeed.runtime.checkpoint  # noqa: F401  (imported before the harness forks)
from zerospeed.models.gpt import GPT, Block, tiny

MB, GAS, SEQ, LR = 2, 2, 16, 3e-3
CURRICULUM = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 4, "max_difficulty": SEQ,
              "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 4}}
# DeepSpeed: the forward at global_steps g gets update_difficulty(g + 1): floor((g+1)/4 * 12 + 4) down to x4
SEQLEN_BY_STEP = [4, 8, 12, 16, 16]
PLD = {"enabled": True, "theta": 0.5, "gamma": 0.1}
RANDOM_LTD = {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
    "enabled": True, "total_layer_num": 2, "random_ltd_layer_num": 1, "random_ltd_layer_id": [1],
    "model_mask_name": None, "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
    "random_ltd_schedule": {"min_value": 4, "max_value": SEQ, "schedule_type": "fixed_linear",
                            "schedule_config": {"require_steps": 4, "seq_per_step": 4}}}}}


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, 256, (MB * GAS * world, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _engine(extra: dict[str, Any]) -> Any:
    import zerospeed

    config = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.99], "eps": 1e-8,
                                                        "weight_decay": 0.0}},
              "zero_optimization": {"stage": 2}, **extra}
    engine, *_ = zerospeed.initialize(model=GPT(tiny(), seed=3), config=config)
    return engine


def _train(engine: Any, steps: int, seen: list[Any] | None = None) -> list[float]:
    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    losses = []
    for _ in range(steps):
        x, y = _batch(engine.global_steps, world)
        total = torch.zeros(())
        for m in range(GAS):
            lo = (m * world + rank) * MB
            _, loss = engine(x[lo:lo + MB], y[lo:lo + MB])
            if seen is not None:
                seen.append((engine.curriculum_scheduler_legacy.get_current_difficulty(), engine.get_pld_theta()))
            engine.backward(loss)
            engine.step()
            total += loss.detach() / GAS
        comm.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def _reference(steps: int, world: int) -> list[float]:
    model = GPT(tiny(), seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    losses = []
    for step in range(steps):
        x, y = _batch(step, world)
        s = SEQLEN_BY_STEP[step]
        logits, _ = model(x[:, :s])
        loss = F.cross_entropy(logits.reshape(-1, 256), y[:, :s].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _curriculum_and_pld(path: str) -> tuple[list[float], list[Any], list[float], Any]:
    extra = {"curriculum_learning": CURRICULUM}
    engine = _engine(extra)
    seen: list[Any] = []
    losses = _train(engine, 3, seen)
    engine.save_checkpoint(path)
    saved = engine.curriculum_scheduler_legacy.get_current_difficulty()
    resumed = _engine(extra)
    resumed.load_checkpoint(path)
    assert resumed.curriculum_scheduler_legacy.get_current_difficulty() == saved == 12
    tail = _train(engine, 2, seen)
    again = _train(resumed, 2)
    # PLD: the forward of step g sees theta(g - 1) (1.0 for the first two steps), as DeepSpeed
    pld_engine = _engine({"progressive_layer_drop": PLD})
    passed: list[Any] = []
    pld_engine.module.register_forward_pre_hook(
        lambda m, a, kw: passed.append((kw.get("progressive_layer_drop"), kw.get("pld_theta"))), with_kwargs=True)
    thetas = []
    for _ in range(4):
        _train(pld_engine, 1)
        thetas.append(pld_engine.get_pld_theta())
    # the forwards of step g got theta(g - 1) (1.0 at steps 0 and 1)
    assert passed == [(True, t) for t in [1.0, *thetas[:3]] for _ in range(GAS)]
    pld_engine.save_checkpoint(path + "_pld")
    pld_resumed = _engine({"progressive_layer_drop": PLD})
    pld_resumed.load_checkpoint(path + "_pld")
    return losses + tail, seen, thetas, (again, tail, pld_resumed.get_pld_theta())


def test_seqlen_curriculum_equals_a_truncating_reference_and_resumes(tmp_path: Any) -> None:
    results = run_distributed(_curriculum_and_pld, 2, str(tmp_path / "ckpt"), timeout=120)
    ref = _reference(5, 2)
    for losses, seen, thetas, (again, tail, theta_loaded) in results:
        assert [d for d, _ in seen[::GAS]] == SEQLEN_BY_STEP
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
        assert again == tail  # the resumed engine continues the schedule (and the training) exactly
        pld = [(1 - 0.5) * math.exp(-0.1 * g) + 0.5 for g in range(4)]
        assert thetas == pytest.approx(pld, rel=1e-12)
        assert theta_loaded == thetas[-1]


def _random_ltd(path: str) -> tuple[list[int], list[float], dict[str, Any]]:
    from zerospeed.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd

    engine = convert_to_random_ltd(_engine({"data_efficiency": RANDOM_LTD}), Block)
    assert engine.random_ltd_enabled() and not engine.pld_enabled() and not engine.curriculum_enabled_legacy()
    kept: list[int] = []
    losses = []
    for _ in range(5):
        losses += _train(engine, 1)
        kept.append(engine.random_ltd_scheduler.get_current_seq())
    engine.save_checkpoint(path)
    resumed = convert_to_random_ltd(_engine({"data_efficiency": RANDOM_LTD}), Block)
    resumed.load_checkpoint(path)
    assert resumed.random_ltd_scheduler.state_dict() == engine.random_ltd_scheduler.state_dict()
    return kept, losses, engine.random_ltd_scheduler.state_dict()


def test_random_ltd_trains_with_its_token_schedule(tmp_path: Any) -> None:
    results = run_distributed(_random_ltd, 2, str(tmp_path / "ckpt"), timeout=120)
    for kept, losses, state in results:
        assert kept == [4, 4, 8, 12, 16]  # update_seq(g): floor(g/4 * 12 + 4) down to a multiple of 4
        assert all(math.isfinite(x) for x in losses)
        # consumed layer-tokens: global batch 8 x (kept x 1 random-LTD layer + 16 x 1 full layer) per step
        assert state["consumed_layer_tokens"] == sum(8 * (k + 16) for k in kept)


# --- curriculum data sampling ---------------------------------------------------------------------------
N_SAMPLES = 200
# DeepSpeed 0.19.8's DeepSpeedDataSampler on the same index files (made by write_metric_index below; DeepSpeed
# reads them), seed 7, global batch 4 (micro 2 x gas 2 at world 1): its first 16 micro-batches.
DS_BATCHES = {
    "one": [[83, 3], [40, 0], [199, 79], [16, 39], [22, 166], [146, 103], [100, 129], [120, 123], [8, 156],
            [62, 190], [196, 181], [155, 112], [90, 140], [78, 131], [54, 23], [31, 134]],
    "two": [[80, 30], [120, 130], [140, 160], [100, 150], [156, 95], [162, 29], [155, 89], [43, 72], [189, 24],
            [123, 82], [10, 92], [44, 101], [124, 175], [188, 137], [14, 151], [60, 33]],
}


def _metrics(name: str, index: dict[str, tuple[str, str]]) -> dict[str, Any]:
    (s1, m1), (s2, _) = index["seqlen"], index["vocab"]
    seqlen = {"index_to_sample_path": s1, "index_to_metric_path": m1, "difficulty_type": "value",
              "clustering_type": "schedule_based"}
    if name == "one":
        return {"seqlen": {**seqlen, "min_difficulty": 2, "max_difficulty": 10, "schedule_type": "fixed_linear",
                           "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 2}}}
    return {"seqlen": {**seqlen, "min_difficulty": 3, "max_difficulty": 10, "schedule_type": "fixed_discrete",
                       "schedule_config": {"difficulty": [3, 6, 10], "max_step": [2, 4]}},
            "vocab": {"index_to_sample_path": s2, "difficulty_type": "percentile", "clustering_type": "schedule_based",
                      "min_difficulty": 40, "max_difficulty": 100, "schedule_type": "fixed_linear",
                      "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 20}}}


def _sampling_engine(name: str, index: dict[str, tuple[str, str]], clusters: str) -> tuple[Any, Any]:
    import zerospeed
    from torch.utils.data import TensorDataset

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "data_efficiency": {"enabled": True, "seed": 7, "data_sampling": {
                  "enabled": True, "num_epochs": 2, "curriculum_learning": {
                      "enabled": True, "data_cluster_path": clusters, "curriculum_metrics": _metrics(name, index)}}}}
    engine, _, loader, _ = zerospeed.initialize(model=torch.nn.Linear(1, 1), config=config,
                                                training_data=TensorDataset(torch.arange(N_SAMPLES)))
    return engine, loader


def _sampling(name: str, index: dict[str, tuple[str, str]], root: str) -> tuple[list[int], list[int]]:
    engine, loader = _sampling_engine(name, index, f"{root}/clusters")
    it = iter(loader)
    first = [int(next(it)[0]) for _ in range(8)]
    engine.save_checkpoint(f"{root}/ckpt")
    engine2, loader2 = _sampling_engine(name, index, f"{root}/clusters")
    engine2.load_checkpoint(f"{root}/ckpt")
    it2 = iter(loader2)
    return first, [int(next(it2)[0]) for _ in range(8)]


@pytest.mark.parametrize("name", ["one", "two"])
def test_curriculum_sampler_draws_deepspeeds_batches_and_resumes(name: str, tmp_path: Any) -> None:
    import numpy as np

    from zerospeed.data_pipeline import write_metric_index

    i = np.arange(N_SAMPLES)
    index = {"seqlen": write_metric_index((i * 7) % 10 + 1, str(tmp_path / "index"), "seqlen"),
             "vocab": write_metric_index((i * 3) % 5, str(tmp_path / "index"), "vocab")}
    (r0_first, r0_next), (r1_first, r1_next) = run_distributed(_sampling, 2, name, index, str(tmp_path), timeout=120)
    got = [[a, b] for a, b in zip(r0_first + r0_next, r1_first + r1_next)]  # rank r takes sample r of each pair
    assert got == DS_BATCHES[name]
