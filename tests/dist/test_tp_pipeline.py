"""tp=2 x pp=2 (world 4): the pipeline's tied-embedding GPT split by AutoTP trains like one process."""

import pytest
import torch

import zerospeed
from zerospeed.parallel.topology import PipeModelDataParallelTopology
from zerospeed.pipe import PipelineModule
from zerospeed.testing import run_distributed

from .pipe_fixtures import SEED, batches, gpt_layers, loss_fn, rank_iter, reference_losses

STEPS, MICRO, GAS, LR, CLIP = 10, 2, 2, 1e-2, 0.5


def _train(stage: int) -> dict:
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    model = PipelineModule(gpt_layers(), topology=topo, loss_fn=loss_fn, seed_layers=True, base_seed=SEED,
                           partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
              "gradient_clipping": CLIP, "zero_optimization": {"stage": stage},
              "tensor_parallel": {"autotp_size": 2}}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    it = rank_iter(batches(STEPS, MICRO, GAS), 0, GAS)
    losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
    split = [n for n, p in engine.module.named_parameters() if id(p) in engine.tensor_parallel.split]
    return {"losses": losses, "norm": engine.get_global_grad_norm(), "split": split,
            "tp": engine.grid.get_slice_parallel_rank(), "stage": engine.stage_id}


@pytest.mark.parametrize("stage", [0, 1])
def test_tp2_pp2_matches_one_process(stage: int) -> None:
    results = run_distributed(_train, 4, stage, timeout=180)
    expected = reference_losses(batches(STEPS, MICRO, GAS), LR, CLIP)
    assert sorted((r["stage"], r["tp"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        assert r["split"], "each stage splits its blocks"
        assert r["losses"] == pytest.approx(expected, rel=1e-5), f"stage {r['stage']} tp {r['tp']}"
    assert len({round(r["norm"], 6) for r in results}) == 1  # one global norm over stages and tp shards
