"""Curriculum, random-LTD and progressive-layer-drop schedules step by step.

The expected lists were produced by DeepSpeed 0.19.8's own ``CurriculumScheduler`` and ``RandomLTDScheduler``
(``update_difficulty(i)`` / ``update_seq(i)`` for i = 0, 1, ...) with the same configs, and hard-coded here.
"""

from __future__ import annotations

import math

import pytest

from zerospeed.config import ConfigError, load_config
from zerospeed.config.errors import NotSupportedYetError
from zerospeed.data_pipeline import CurriculumScheduler, ProgressiveLayerDrop, RandomLTDScheduler

CASES = {
    "linear": ({"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
                "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}},
               [8, 8, 16, 24, 24, 32, 40, 40, 48, 56, 64, 64, 64]),
    "root": ({"min_difficulty": 8, "max_difficulty": 1024, "schedule_type": "fixed_root",
              "schedule_config": {"total_curriculum_step": 20, "difficulty_step": 16, "root_degree": 2}},
             [16, 224, 320, 400, 448, 512, 560, 608, 640, 688, 720, 752, 784, 816, 848, 880, 912, 944, 960, 992,
              1024, 1024]),
    "root3": ({"min_difficulty": 3, "max_difficulty": 100, "schedule_type": "fixed_root",
               "schedule_config": {"total_curriculum_step": 15, "difficulty_step": 5, "root_degree": 3}},
              [5, 40, 50, 55, 65, 70, 70, 75, 80, 80, 85, 90, 90, 95, 95, 100, 100]),
    "discrete": ({"min_difficulty": 1, "max_difficulty": 3, "schedule_type": "fixed_discrete",
                  "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5, 10]}},
                 [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_curriculum_schedule_equals_deepspeeds(name: str) -> None:
    config, expected = CASES[name]
    sched = CurriculumScheduler(config)
    got = [sched.update_difficulty(step) for step in range(len(expected))]
    assert got == expected
    assert all(type(d) is int for d in got)  # a sequence length must stay an int


def test_custom_schedule_and_the_max_difficulty_latch() -> None:
    sched = CurriculumScheduler({"min_difficulty": 10, "max_difficulty": 40, "schedule_type": "custom"})
    with pytest.raises(RuntimeError, match="set_custom_get_difficulty"):
        sched.update_difficulty(1)
    sched.set_custom_get_difficulty(lambda step: 10 + 3 * step if step % 4 else 7)
    got = [sched.update_difficulty(step) for step in range(15)]
    assert got == [7, 13, 16, 19, 7, 25, 28, 31, 7, 37, 40, 40, 40, 40, 40]  # DeepSpeed 0.19.8's


def test_curriculum_state_dict_resumes_the_schedule() -> None:
    config, expected = CASES["linear"]
    first = CurriculumScheduler(config)
    for step in range(6):
        first.update_difficulty(step)
    second = CurriculumScheduler(config)
    second.load_state_dict(first.state_dict())
    assert second.get_current_difficulty() == expected[5]
    assert [second.update_difficulty(s) for s in range(6, 13)] == expected[6:]


@pytest.mark.parametrize("bad,match", [
    ({"schedule_type": "fixed_root", "schedule_config": {"total_curriculum_step": 5, "difficulty_step": 8}},
     "root_degree"),
    ({"schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [1, 2], "max_step": [1, 2]}},
     "one more entry"),
    ({"schedule_type": "fixed_linear", "schedule_config": {"difficulty_step": 8}}, "total_curriculum_step"),
])
def test_schedule_config_errors_name_the_key(bad: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config({"train_batch_size": 1, "curriculum_learning": {"enabled": True, "min_difficulty": 8,
                                                                      "max_difficulty": 64, **bad}})


def test_random_ltd_token_schedule_equals_deepspeeds() -> None:
    config = {"total_layer_num": 4, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
              "random_ltd_schedule": {"min_value": 16, "max_value": 128, "schedule_type": "fixed_linear",
                                      "schedule_config": {"require_steps": 10, "seq_per_step": 16}}}
    sched = RandomLTDScheduler(config, global_batch_size=8)
    got = []
    for step in range(13):
        sched.update_seq(step)
        sched.update_seq(step)  # a second forward in the same step consumes nothing new
        got.append([sched.get_current_seq(), sched.state["consumed_layer_tokens"]])
    assert got == [[16, 2304], [16, 4608], [32, 7168], [48, 9984], [48, 12800], [64, 15872], [80, 19200],
                   [80, 22528], [96, 26112], [112, 29952], [128, 34048], [128, 38144], [128, 42240]]
    again = RandomLTDScheduler(config, global_batch_size=8)
    again.load_state_dict(sched.state_dict())
    assert again.state_dict() == sched.state_dict()


def test_pld_theta_follows_deepspeeds_formula() -> None:
    theta, gamma = 0.5, 0.01
    pld = ProgressiveLayerDrop(theta=theta, gamma=gamma)
    assert pld.get_state() == {"progressive_layer_drop": True, "pld_theta": 1.0}
    for step in (0, 1, 10, 100, 1000):
        pld.update_state(step)
        assert pld.get_theta() == pytest.approx((1 - theta) * math.exp(-gamma * step) + theta, rel=1e-15)
    assert pld.get_theta() == pytest.approx(0.5 + 0.5 * math.exp(-10.0))


def test_sections_off_are_accepted_and_unfinished_keys_refused() -> None:
    load_config({"train_batch_size": 1, "progressive_layer_drop": {"enabled": False},
                 "curriculum_learning": {"enabled": False}, "data_efficiency": {"enabled": False}})
    load_config({"train_batch_size": 1, "data_efficiency": {"data_sampling": {"dynamic_batching": {
        "enabled": True, "max_tokens": 100}}}})  # (implemented: tests/unit/test_dynamic_batching.py)
    with pytest.raises(NotSupportedYetError, match="layer_token_lr_schedule"):
        load_config({"train_batch_size": 1, "data_efficiency": {"data_routing": {"random_ltd": {
            "layer_token_lr_schedule": {"enabled": True}}}}})


def test_indexed_files_round_trip_and_the_metric_index(tmp_path) -> None:
    import numpy as np

    from zerospeed.data_pipeline import read_indexed, write_indexed, write_metric_index

    items = [np.array([3, 1, 2]), np.array([], dtype=np.int64), np.array([7])]
    write_indexed(str(tmp_path / "x"), items, np.uint16)
    back = read_indexed(str(tmp_path / "x"))
    assert [a.tolist() for a in back] == [[3, 1, 2], [], [7]] and back[0].dtype == np.uint16
    samples, metrics = write_metric_index([5, 2, 5, 9, 2], str(tmp_path / "idx"), "len")
    assert [r.tolist() for r in read_indexed(samples)] == [[1, 4], [0, 2], [3]]  # by ascending value
    assert [r.tolist() for r in read_indexed(metrics)] == [[2], [5], [9]]
    with pytest.raises(ValueError, match="integer"):
        write_metric_index([0.5, 1.5], str(tmp_path / "idx"), "float")
