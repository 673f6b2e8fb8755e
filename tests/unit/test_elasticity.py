"""Elastic batch sizes against DeepSpeed 0.19.6: its own test configurations (tests/unit/elasticity/
test_elastic.py) and a grid of 330 inputs whose results DeepSpeed's code wrote into
``fixtures/deepspeed_elasticity.json`` (``scripts/deepspeed_elasticity_reference.py``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

import zerospeed.elasticity.config as elastic_config  # DeepSpeed's path for the error classes
from zerospeed.config import ConfigError, load_config
from zerospeed.elasticity import (ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize,
                                  compute_elastic_config, elasticity_enabled)

DS_VERSION = "0.19.6"
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "deepspeed_elasticity.json").read_text())
BASE = {"elasticity": {"enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17],
                       "min_gpus": 32, "max_gpus": 1500, "min_time": 20, "version": 0.1}}


@pytest.fixture
def ds_config() -> dict:
    return copy.deepcopy(BASE)


@pytest.fixture(autouse=True)
def _no_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("DEEPSPEED_ELASTICITY_CONFIG", raising=False)


# --- DeepSpeed's tests ---------------------------------------------------------------------------
def test_basic_10k(ds_config: dict) -> None:
    batch, valid = compute_elastic_config(ds_config, DS_VERSION)
    for n in valid:
        assert batch % n == 0 and any(batch // n % mb == 0 for mb in ds_config["elasticity"]["micro_batch_sizes"])
    assert len(valid) == 23 and batch == 9792
    assert all(type(n) is int for n in valid)


def test_old_version(ds_config: dict) -> None:
    with pytest.raises(ElasticityError):
        compute_elastic_config(ds_config, "0.2")


def test_disabled(ds_config: dict) -> None:
    ds_config["elasticity"]["enabled"] = False
    with pytest.raises(ElasticityError):
        compute_elastic_config(ds_config, DS_VERSION)


def test_valid_world_size(ds_config: dict) -> None:
    assert compute_elastic_config(ds_config, DS_VERSION, world_size=64)[2] == 17


def test_invalid_world_size(ds_config: dict) -> None:
    with pytest.raises(ElasticityIncompatibleWorldSize):
        compute_elastic_config(ds_config, DS_VERSION, world_size=128)


def test_return_microbatch_without_world_size(ds_config: dict) -> None:
    with pytest.raises(ElasticityConfigError):
        compute_elastic_config(ds_config, DS_VERSION, return_microbatch=True)


def test_return_microbatch_world_size_from_env(ds_config: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "64")
    batch, _, micro = compute_elastic_config(ds_config, DS_VERSION, return_microbatch=True)
    assert (batch, micro) == (9792, 17)
    monkeypatch.setenv("WORLD_SIZE", "128")
    with pytest.raises(ElasticityIncompatibleWorldSize):
        compute_elastic_config(ds_config, DS_VERSION, return_microbatch=True)


@pytest.mark.parametrize("edit", [{"version": "0.3"}, {"max_train_batch_size": None}, {"micro_batch_sizes": None},
                                  {"model_parallel_size": 4, "num_gpus_per_node": 8, "version": 0.1}])
def test_bad_sections(ds_config: dict, edit: dict) -> None:
    for key, value in edit.items():
        if value is None:
            del ds_config["elasticity"][key]
        else:
            ds_config["elasticity"][key] = value
    with pytest.raises(ElasticityError):
        compute_elastic_config(ds_config, DS_VERSION)


def test_empty_config() -> None:
    with pytest.raises(ElasticityError):
        compute_elastic_config({"elasticity": {"enabled": True}}, DS_VERSION)


def test_model_parallel_v2(ds_config: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    ds_config["elasticity"].update(model_parallel_size=16, num_gpus_per_node=8, version=0.2)
    with pytest.raises(ElasticityError):  # 8 GPUs per node cannot hold a 16-way model replica
        compute_elastic_config(ds_config, DS_VERSION, world_size=16)
    ds_config["elasticity"]["model_parallel_size"] = 4
    monkeypatch.setenv("WORLD_SIZE", "16")
    compute_elastic_config(ds_config, DS_VERSION)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ElasticityConfigError, match="WORLD_SIZE"):  # v0.2 needs a world size
        compute_elastic_config(ds_config, DS_VERSION)


@pytest.mark.parametrize("mp, micro_batch_sizes, expected", [(1, [4, 8], 4), (2, [4, 8], 8), (4, [4, 8], 8),
                                                             (2, [8], 8), (4, [8], 8)])
def test_model_parallel_v2_microbatch_is_per_dp_rank(ds_config: dict, monkeypatch: pytest.MonkeyPatch, mp: int,
                                                     micro_batch_sizes: list[int], expected: int) -> None:
    """DeepSpeed's later fix (0.19.6 returned 4 / None for mp > 1): the micro batch divides the batch per
    data-parallel rank."""
    ds_config["elasticity"].update(version=0.2, model_parallel_size=mp, num_gpus_per_node=8, max_train_batch_size=64,
                                   micro_batch_sizes=micro_batch_sizes, min_gpus=16, max_gpus=16)
    monkeypatch.setenv("WORLD_SIZE", "16")
    batch, _, micro = compute_elastic_config(ds_config, DS_VERSION, return_microbatch=True)
    assert micro == expected and batch // (16 // mp) % micro == 0


@pytest.mark.parametrize("key, value", [("micro_batch_sizes", [1, 4, -1, 2, -10]), ("min_gpus", -1),
                                        ("max_gpus", -1), ("micro_batch_sizes", 5),
                                        ("micro_batch_sizes", ["a", None, 0.5]), ("micro_batch_sizes", [2, 0.5, 4]),
                                        ("min_gpus", 2000), ("min_time", -1), ("num_gpus_per_node", 0),
                                        ("model_parallel_size", 0), ("version", "x")])
def test_invalid_config_values(ds_config: dict, key: str, value: object) -> None:
    ds_config["elasticity"][key] = value
    with pytest.raises(ElasticityConfigError) as info:
        compute_elastic_config(ds_config, DS_VERSION)
    assert key in str(info.value) or key == "min_gpus"  # min > max names both


def test_proper_mbsz(ds_config: dict) -> None:
    ds_config["elasticity"].update(max_train_batch_size=32, micro_batch_sizes=[1, 2, 3, 7], min_gpus=1)
    assert compute_elastic_config(ds_config, DS_VERSION, world_size=4)[2] == 3


def test_batch_size_within_max(ds_config: dict) -> None:
    ds_config["elasticity"].update(max_train_batch_size=100, micro_batch_sizes=[8, 10, 12], min_gpus=1)
    assert compute_elastic_config(ds_config, DS_VERSION)[0] <= 100


def test_error_classes_and_paths() -> None:
    assert issubclass(ElasticityConfigError, ElasticityError) and issubclass(ElasticityConfigError, ConfigError)
    assert issubclass(ElasticityIncompatibleWorldSize, ElasticityError) and issubclass(ElasticityError, ValueError)
    assert elastic_config.ElasticityError is ElasticityError
    assert elasticity_enabled(BASE) and not elasticity_enabled({}) and not elasticity_enabled({"elasticity": {}})
    with pytest.raises(ValueError):
        compute_elastic_config("not a dict", DS_VERSION)  # type: ignore[arg-type]
    with pytest.raises(ElasticityConfigError, match="missing"):
        compute_elastic_config({}, DS_VERSION)


# --- the grid DeepSpeed's code computed -----------------------------------------------------------
_ERRORS = {"ValueError": ValueError, "ElasticityError": ElasticityError,
           "ElasticityConfigError": ElasticityConfigError,
           "ElasticityIncompatibleWorldSize": ElasticityIncompatibleWorldSize}


def test_grid_matches_deepspeed_0_19_6(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = FIXTURE["cases"]
    assert len(cases) == 330 and sum("fixed_micro" in c for c in cases) == 11
    for i, case in enumerate(cases):
        if case["env_world_size"] is not None:
            monkeypatch.setenv("WORLD_SIZE", str(case["env_world_size"]))
        else:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        args = ({"elasticity": case["elasticity"]}, DS_VERSION, case["world_size"], case["return_microbatch"])
        expected = case["deepspeed"]
        if expected[0] == "error":
            with pytest.raises(_ERRORS[expected[1]]):
                compute_elastic_config(*args)
            continue
        got = list(compute_elastic_config(*args))
        want = expected[1:]
        if "fixed_micro" in case:  # version 0.2, model parallel: the micro batch per data-parallel rank
            want[2] = case["fixed_micro"]
        assert got == want, f"case {i}: {case}"


# --- wired into the config's batch sizes -----------------------------------------------------------
def _elastic(**extra: object) -> dict:
    return {"elasticity": {"enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17],
                           "min_gpus": 32, "max_gpus": 1500, "version": 0.1, **extra}}


def test_batch_sizes_come_from_elasticity() -> None:
    cfg = load_config(_elastic())
    b = cfg.batch(64)
    assert (b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps) == (9792, 17, 9)
    b = cfg.batch(36)  # 9792 / 36 = 272 = 16 * 17: the largest micro batch that divides it
    assert (b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps) == (9792, 17, 16)
    with pytest.raises(ElasticityIncompatibleWorldSize):
        cfg.batch(65)
    assert load_config({"train_batch_size": 8, "elasticity": {"enabled": False}}).batch(2).train_batch_size == 8


def test_explicit_batch_keys_conflict_unless_ignored() -> None:
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        with pytest.raises(ElasticityConfigError, match=key):
            load_config({key: 2, **_elastic()})
    cfg = load_config({"train_batch_size": 2, **_elastic(ignore_non_elastic_batch_info=True)})
    assert cfg.batch(64).train_batch_size == 9792


def test_bad_section_in_a_config_is_an_elasticity_error() -> None:
    with pytest.raises(ElasticityConfigError, match="elasticity.min_gpus"):
        load_config(_elastic(min_gpus=0))
    with pytest.raises(ElasticityConfigError, match="max_train_batch_size"):
        load_config({"elasticity": {"enabled": True, "micro_batch_sizes": [2]}})
    with pytest.raises(ConfigError, match="Did you mean 'max_gpus'"):
        load_config(_elastic(max_gpu=4))


def test_scheduler_config_must_match(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps(_elastic(max_train_batch_size=27)["elasticity"]))
    with pytest.raises(ElasticityConfigError, match="max_train_batch_size"):
        load_config(_elastic())
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps(_elastic()))  # a whole config is read too
    load_config(_elastic())
