"""`zerospeed autotune` end to end on two processes: the model-info run, the user's config as `default`,
micro-batch ascent per ZeRO stage, memory pruning (a stage that cannot fit is never launched), and the files
DeepSpeed's autotuner writes."""

from __future__ import annotations

import json
from pathlib import Path

from zerospeed.autotuning import Autotuner

SCRIPT = Path(__file__).parent / "scripts" / "autotune_train.py"


def test_autotune_end_to_end(tmp_path) -> None:
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 0},
            "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 3,
                           "results_dir": str(tmp_path / "results"), "exps_dir": str(tmp_path / "exps"),
                           "num_tuning_micro_batch_sizes": 1, "max_train_micro_batch_size_per_gpu": 4}}
    (tmp_path / "ds.json").write_text(json.dumps(base))
    num_params = 32 * 64 + 64 + 64 * 32 + 32
    # at world 2 the model states take 16 / 12 / 10 / 8 bytes per parameter per rank at stages 0-3; tell the
    # tuner the machine has room (half of it, per rank) for 9: only stage 3 may run
    tuner = Autotuner(str(SCRIPT), ["--deepspeed_config", str(tmp_path / "ds.json")], nproc=2, timeout_s=180,
                      available_bytes=2 * 2 * 9 * num_params)
    best = tuner.tune()
    names = [r.name for r in tuner.results]
    notes = {r.name: r.note for r in tuner.results}
    assert names[0] == "default" and best.metric is not None
    assert all(notes[f"z{s}"].startswith("pruned") for s in (0, 1, 2))  # never launched
    z3 = [n for n in names if n.startswith("z3_")]
    assert z3 == ["z3_tmbspg1_gas1"] and not any(n.startswith(("z0_", "z1_", "z2_")) for n in names)
    best_metric = max(r.metric for r in tuner.results if r.metric is not None)
    default = next(r for r in tuner.results if r.name == "default")
    assert best.metric == best_metric >= default.metric  # at least as fast as the user's config, measured
    optimal = json.loads((tmp_path / "results" / "ds_config_optimal.json").read_text())
    assert "autotuning" not in optimal and optimal["train_micro_batch_size_per_gpu"] in (1, 2, 4)
    assert "zerospeed launch --nproc-per-node 2" in (tmp_path / "results" / "cmd_optimal.txt").read_text()
    summary = (tmp_path / "results" / "summary.txt").read_text()
    assert "default" in summary and "pruned" in summary and "optimal:" in summary
    assert json.loads((tmp_path / "results" / "model_info" / "model_info.json").read_text())["num_params"] == num_params
