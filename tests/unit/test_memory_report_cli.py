"""``zerospeed report memory``: its flags, the config it builds, and the stage-2/3 bucket cap it helps find."""

from __future__ import annotations

import json

import pytest

from zerospeed.launcher.cli import build_parser
from zerospeed.launcher.command import UsageError
from zerospeed.launcher.memory_report import config_for, presets, run
from zerospeed.zero.partition import TRANSIENT_BUCKET_PARTS, plan_partitions, reduce_bucket_numel


def test_report_memory_parses_and_builds_the_config(tmp_path) -> None:
    args = build_parser().parse_args(["report", "memory", "--preset", "gpt2s", "--stage", "3", "--world-size", "2"])
    assert args.what == "memory" and args.preset == "gpt2s" and args.stage == 3
    cfg = config_for(args)
    assert cfg["zero_optimization"] == {"stage": 3} and cfg["train_micro_batch_size_per_gpu"] == 4
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage3_max_reuse_distance": 0}, "gradient_clipping": 0.5}))
    args = build_parser().parse_args(["report", "memory", "--stage", "3", "--config", str(user)])
    cfg = config_for(args)
    assert cfg["zero_optimization"] == {"stage": 3, "stage3_max_reuse_distance": 0}
    assert cfg["gradient_clipping"] == 0.5
    assert build_parser().parse_args(["report"]).what == "env"  # the plain report is unchanged


def test_gpt2s_preset_is_the_gpt2_small_shape() -> None:
    cfg = presets()["gpt2s"]()
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.block_size) == (12, 768, 12, 50257, 512)


def test_report_memory_rejects_an_unknown_preset() -> None:
    args = build_parser().parse_args(["report", "memory", "--preset", "nope"])
    with pytest.raises(UsageError, match="--preset"):
        run(args)


def test_stage2_buckets_are_capped_below_deepspeeds_default() -> None:
    numels = [1000] * 16
    assert reduce_bucket_numel(500_000_000, numels, stage=0, world=2) == 16_000 // TRANSIENT_BUCKET_PARTS
    # stage 1: views of its full buffer, cut so the first reduce-scatters overlap backward
    assert reduce_bucket_numel(500_000_000, numels, stage=1, world=2) == 16_000 // TRANSIENT_BUCKET_PARTS
    assert reduce_bucket_numel(500_000_000, numels, stage=2, world=1) == 500_000_000
    cap = reduce_bucket_numel(500_000_000, numels, stage=2, world=2)
    assert cap == 16_000 // TRANSIENT_BUCKET_PARTS
    assert reduce_bucket_numel(100, numels, stage=3, world=2) == 100  # a smaller user setting wins
    plan = plan_partitions(numels, 2, cap)
    assert len(plan.buckets) == TRANSIENT_BUCKET_PARTS
