"""The autotuner's pure parts: DeepSpeed's tuning spaces and experiment names, the search strategies, the
memory pruning, and the config section."""

from __future__ import annotations

import pytest

from zerospeed.autotuning import DEFAULT_TUNING_SPACE, TUNERS, canonical_name, expand
from zerospeed.autotuning.memory import fits, model_state_bytes
from zerospeed.autotuning.space import tuning_keys
from zerospeed.config import ConfigError, load_config


def test_expand_default_spaces() -> None:
    assert len(expand(DEFAULT_TUNING_SPACE[0])) == 1
    assert len(expand(DEFAULT_TUNING_SPACE[1])) == 9
    z2 = expand(DEFAULT_TUNING_SPACE[2])
    assert len(z2) == 2 * 2 * 3 * 3 * 2
    assert all(isinstance(e["zero_optimization"]["reduce_bucket_size"], int) for e in z2)
    assert {e["zero_optimization"]["stage"] for e in z2} == {2}
    assert len({str(e) for e in z2}) == len(z2)


def test_canonical_names_as_deepspeed() -> None:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 500000000}}
    keys = tuning_keys(DEFAULT_TUNING_SPACE[2])
    assert canonical_name(cfg, keys, prefix="z2_") == "z2_tmbspg4_gas1_ocT_rbs5.0e+08"


@pytest.mark.parametrize("kind", sorted(TUNERS))
def test_tuners_find_the_best_and_stop_early(kind: str) -> None:
    exps = [{"x": i} for i in range(20)]
    calls = []

    def measure(exp: dict) -> float | None:
        calls.append(exp["x"])
        return None if exp["x"] == 3 else float(exp["x"] == 7) * 10 - abs(exp["x"] - 7)

    best, metric = TUNERS[kind](exps, num_trials=20, early_stopping=25, seed=1).tune(measure)
    assert best == {"x": 7} and metric == 10.0 and len(calls) == 20
    few = TUNERS[kind]([{"x": i} for i in range(20)], num_trials=20, early_stopping=2).tune(lambda e: 1.0)
    assert few[0] is not None  # the first result, then two without improvement: stopped after 3


def test_memory_pruning() -> None:
    n = 1_000_000
    assert model_state_bytes(n, 0, 2) == 16 * n
    assert model_state_bytes(n, 1, 2) == 4 * n + 4 * n + 4 * n
    assert model_state_bytes(n, 3, 2) == 8 * n
    cfg = {"zero_optimization": {"stage": 3}}
    assert fits(cfg, n, 2, available=64 * n) and not fits({"zero_optimization": {"stage": 0}}, n, 2, 40 * n)


def test_config_section() -> None:
    cfg = load_config({"train_batch_size": 2, "autotuning": {"enabled": True, "fast": False, "tuner_type": "random",
                                                             "metric": "latency", "arg_mappings": {"a": "--b"}}})
    assert cfg.autotuning.tuner_type == "random" and cfg.autotuning.start_profile_step == 3
    with pytest.raises(ConfigError, match="tuner_type"):
        load_config({"train_batch_size": 2, "autotuning": {"tuner_type": "grid"}})
    with pytest.raises(ConfigError, match="end_profile_step"):
        load_config({"train_batch_size": 2, "autotuning": {"enabled": True, "start_profile_step": 5,
                                                           "end_profile_step": 5}})


def test_arg_mappings_and_config_argument(tmp_path) -> None:
    import json

    from zerospeed.autotuning import Autotuner

    cfg = {"train_micro_batch_size_per_gpu": 8, "autotuning": {
        "results_dir": str(tmp_path / "r"), "exps_dir": str(tmp_path / "e"),
        "arg_mappings": {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}}}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    tuner = Autotuner("train.py", ["--deepspeed_config", str(tmp_path / "ds.json"), "--per_device_train_batch_size",
                                   "8", "--epochs=2"])
    assert tuner._args_with("/x.json", {"train_micro_batch_size_per_gpu": 4}) == [
        "--deepspeed_config", "/x.json", "--per_device_train_batch_size", "4", "--epochs=2"]
    with pytest.raises(ValueError, match="name no config"):
        Autotuner("train.py", ["--lr", "1"])


def test_overwrite_false_reuses_results(tmp_path) -> None:
    import json

    from zerospeed.autotuning import Autotuner

    cfg = {"train_micro_batch_size_per_gpu": 1, "autotuning": {"results_dir": str(tmp_path / "r"), "overwrite": False,
                                                              "exps_dir": str(tmp_path / "e")}}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    (tmp_path / "r" / "z1_x").mkdir(parents=True)
    (tmp_path / "r" / "z1_x" / "metrics.json").write_text('{"throughput": 12.5}')
    tuner = Autotuner("missing_script.py", ["--config", str(tmp_path / "ds.json")])
    result = tuner.run("z1_x", {"zero_optimization": {"stage": 1}})  # not launched: the script does not exist
    assert result.metric == 12.5 and result.note == "reused"
