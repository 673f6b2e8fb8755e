"""DeepSpeed's ZeRO-2/3 model-state memory estimators: same numbers and table as DeepSpeed 0.19.8.

The fixtures below were printed by DeepSpeed 0.19.8's own ``estimate_zero2_model_states_mem_needs`` and
``estimate_zero3_model_states_mem_needs`` (CPU accelerator) for a grid of model sizes and cluster shapes.
"""

from __future__ import annotations

import pytest
from torch import nn

from zerospeed.runtime.zero.stage3 import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from zerospeed.runtime.zero.stage_1_and_2 import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_live,
)

Z2 = [
    ((130000000, 1, 1, True), (3120000000, 260000000)),
    ((130000000, 1, 1, False), (780000000, 2600000000)),
    ((130000000, 8, 1, True), (6240000000, 260000000)),
    ((130000000, 8, 1, False), (6240000000, 552500000)),
    ((130000000, 8, 4, True), (24960000000, 260000000)),
    ((130000000, 8, 4, False), (6240000000, 333125000)),
    ((2700000000, 1, 1, True), (64800000000, 5400000000)),
    ((2700000000, 1, 1, False), (16200000000, 54000000000)),
    ((2700000000, 8, 1, True), (129600000000, 5400000000)),
    ((2700000000, 8, 1, False), (129600000000, 11475000000)),
    ((2700000000, 8, 4, True), (518400000000, 5400000000)),
    ((2700000000, 8, 4, False), (129600000000, 6918750000)),
    ((70000000000, 1, 1, True), (1680000000000, 140000000000)),
    ((70000000000, 1, 1, False), (420000000000, 1400000000000)),
    ((70000000000, 8, 1, True), (3360000000000, 140000000000)),
    ((70000000000, 8, 1, False), (3360000000000, 297500000000)),
    ((70000000000, 8, 4, True), (13440000000000, 140000000000)),
    ((70000000000, 8, 4, False), (3360000000000, 179375000000)),
]
Z3 = [
    ((130000000, 39000000, 1, 1, True, True, True), (3510000000, 156000000, 156000000)),
    ((130000000, 39000000, 1, 1, True, True, False), (3510000000, 156000000, 156000000)),
    ((130000000, 39000000, 1, 1, True, False, True), (3120000000, 416000000, 156000000)),
    ((130000000, 39000000, 1, 1, True, False, False), (3120000000, 416000000, 156000000)),
    ((130000000, 39000000, 1, 1, False, True, True), (234000000, 2496000000, 156000000)),
    ((130000000, 39000000, 1, 1, False, True, False), (780000000, 2496000000, 156000000)),
    ((130000000, 39000000, 1, 1, False, False, True), (234000000, 2496000000, 156000000)),
    ((130000000, 39000000, 1, 1, False, False, False), (780000000, 2496000000, 156000000)),
    ((130000000, 39000000, 8, 1, True, True, True), (3510000000, 156000000, 156000000)),
    ((130000000, 39000000, 8, 1, True, True, False), (6240000000, 156000000, 156000000)),
    ((130000000, 39000000, 8, 1, True, False, True), (3120000000, 188500000, 156000000)),
    ((130000000, 39000000, 8, 1, True, False, False), (6240000000, 188500000, 156000000)),
    ((130000000, 39000000, 8, 1, False, True, True), (1872000000, 448500000, 156000000)),
    ((130000000, 39000000, 8, 1, False, True, False), (6240000000, 448500000, 156000000)),
    ((130000000, 39000000, 8, 1, False, False, True), (1872000000, 448500000, 156000000)),
    ((130000000, 39000000, 8, 1, False, False, False), (6240000000, 448500000, 156000000)),
    ((130000000, 39000000, 8, 4, True, True, True), (877500000, 156000000, 156000000)),
    ((130000000, 39000000, 8, 4, True, True, False), (6240000000, 156000000, 156000000)),
    ((130000000, 39000000, 8, 4, True, False, True), (780000000, 164125000, 156000000)),
    ((130000000, 39000000, 8, 4, True, False, False), (6240000000, 164125000, 156000000)),
    ((130000000, 39000000, 8, 4, False, True, True), (1872000000, 229125000, 156000000)),
    ((130000000, 39000000, 8, 4, False, True, False), (6240000000, 229125000, 156000000)),
    ((130000000, 39000000, 8, 4, False, False, True), (1872000000, 229125000, 156000000)),
    ((130000000, 39000000, 8, 4, False, False, False), (6240000000, 229125000, 156000000)),
    ((2700000000, 120000000, 1, 1, True, True, True), (72900000000, 480000000, 480000000)),
    ((2700000000, 120000000, 1, 1, True, True, False), (72900000000, 480000000, 480000000)),
    ((2700000000, 120000000, 1, 1, True, False, True), (64800000000, 5880000000, 480000000)),
    ((2700000000, 120000000, 1, 1, True, False, False), (64800000000, 5880000000, 480000000)),
    ((2700000000, 120000000, 1, 1, False, True, True), (720000000, 49080000000, 480000000)),
    ((2700000000, 120000000, 1, 1, False, True, False), (16200000000, 49080000000, 480000000)),
    ((2700000000, 120000000, 1, 1, False, False, True), (720000000, 49080000000, 480000000)),
    ((2700000000, 120000000, 1, 1, False, False, False), (16200000000, 49080000000, 480000000)),
    ((2700000000, 120000000, 8, 1, True, True, True), (72900000000, 480000000, 480000000)),
    ((2700000000, 120000000, 8, 1, True, True, False), (129600000000, 480000000, 480000000)),
    ((2700000000, 120000000, 8, 1, True, False, True), (64800000000, 1155000000, 480000000)),
    ((2700000000, 120000000, 8, 1, True, False, False), (129600000000, 1155000000, 480000000)),
    ((2700000000, 120000000, 8, 1, False, True, True), (5760000000, 6555000000, 480000000)),
    ((2700000000, 120000000, 8, 1, False, True, False), (129600000000, 6555000000, 480000000)),
    ((2700000000, 120000000, 8, 1, False, False, True), (5760000000, 6555000000, 480000000)),
    ((2700000000, 120000000, 8, 1, False, False, False), (129600000000, 6555000000, 480000000)),
    ((2700000000, 120000000, 8, 4, True, True, True), (18225000000, 480000000, 480000000)),
    ((2700000000, 120000000, 8, 4, True, True, False), (129600000000, 480000000, 480000000)),
    ((2700000000, 120000000, 8, 4, True, False, True), (16200000000, 648750000, 480000000)),
    ((2700000000, 120000000, 8, 4, True, False, False), (129600000000, 648750000, 480000000)),
    ((2700000000, 120000000, 8, 4, False, True, True), (5760000000, 1998750000, 480000000)),
    ((2700000000, 120000000, 8, 4, False, True, False), (129600000000, 1998750000, 480000000)),
    ((2700000000, 120000000, 8, 4, False, False, True), (5760000000, 1998750000, 480000000)),
    ((2700000000, 120000000, 8, 4, False, False, False), (129600000000, 1998750000, 480000000)),
    ((70000000000, 1000000000, 1, 1, True, True, True), (1890000000000, 4000000000, 4000000000)),
    ((70000000000, 1000000000, 1, 1, True, True, False), (1890000000000, 4000000000, 4000000000)),
    ((70000000000, 1000000000, 1, 1, True, False, True), (1680000000000, 144000000000, 4000000000)),
    ((70000000000, 1000000000, 1, 1, True, False, False), (1680000000000, 144000000000, 4000000000)),
    ((70000000000, 1000000000, 1, 1, False, True, True), (6000000000, 1264000000000, 4000000000)),
    ((70000000000, 1000000000, 1, 1, False, True, False), (420000000000, 1264000000000, 4000000000)),
    ((70000000000, 1000000000, 1, 1, False, False, True), (6000000000, 1264000000000, 4000000000)),
    ((70000000000, 1000000000, 1, 1, False, False, False), (420000000000, 1264000000000, 4000000000)),
    ((70000000000, 1000000000, 8, 1, True, True, True), (1890000000000, 4000000000, 4000000000)),
    ((70000000000, 1000000000, 8, 1, True, True, False), (3360000000000, 4000000000, 4000000000)),
    ((70000000000, 1000000000, 8, 1, True, False, True), (1680000000000, 21500000000, 4000000000)),
    ((70000000000, 1000000000, 8, 1, True, False, False), (3360000000000, 21500000000, 4000000000)),
    ((70000000000, 1000000000, 8, 1, False, True, True), (48000000000, 161500000000, 4000000000)),
    ((70000000000, 1000000000, 8, 1, False, True, False), (3360000000000, 161500000000, 4000000000)),
    ((70000000000, 1000000000, 8, 1, False, False, True), (48000000000, 161500000000, 4000000000)),
    ((70000000000, 1000000000, 8, 1, False, False, False), (3360000000000, 161500000000, 4000000000)),
    ((70000000000, 1000000000, 8, 4, True, True, True), (472500000000, 4000000000, 4000000000)),
    ((70000000000, 1000000000, 8, 4, True, True, False), (3360000000000, 4000000000, 4000000000)),
    ((70000000000, 1000000000, 8, 4, True, False, True), (420000000000, 8375000000, 4000000000)),
    ((70000000000, 1000000000, 8, 4, True, False, False), (3360000000000, 8375000000, 4000000000)),
    ((70000000000, 1000000000, 8, 4, False, True, True), (48000000000, 43375000000, 4000000000)),
    ((70000000000, 1000000000, 8, 4, False, True, False), (3360000000000, 43375000000, 4000000000)),
    ((70000000000, 1000000000, 8, 4, False, False, True), (48000000000, 43375000000, 4000000000)),
    ((70000000000, 1000000000, 8, 4, False, False, False), (3360000000000, 43375000000, 4000000000)),
]


@pytest.mark.parametrize("args,want", Z2)
def test_zero2_numbers_equal_deepspeeds(args: tuple, want: tuple) -> None:
    assert estimate_zero2_model_states_mem_needs(*args) == want


@pytest.mark.parametrize("args,want", Z3)
def test_zero3_numbers_equal_deepspeeds(args: tuple, want: tuple) -> None:
    assert estimate_zero3_model_states_mem_needs(*args) == want


def test_printed_tables(capsys) -> None:
    estimate_zero3_model_states_mem_needs_all_cold(int(2.7e9), int(1.2e8), 8, 2)
    out = capsys.readouterr().out.splitlines()
    assert out[:4] == ["Estimated memory needed for params, optim states and gradients for a:",
                       "HW: Setup with 2 nodes, 8 GPUs per node.",
                       "SW: Model with 2700M total params, 120M largest layer params.",
                       "  per CPU  |  per GPU |   Options"]
    assert out[4] == "   33.95GB |   0.45GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1"
    assert out[8] == "    5.36GB |   3.28GB | offload_param=none, offload_optimizer=none, zero_init=1"
    assert len(out) == 10


def test_all_live_counts_tied_parameters_once(capsys) -> None:
    emb = nn.Embedding(1000, 64)
    head = nn.Linear(64, 1000, bias=False)
    head.weight = emb.weight  # tied: 64k parameters, not 128k
    model = nn.Sequential(emb, nn.Linear(64, 64), head)
    estimate_zero2_model_states_mem_needs_all_live(model)
    assert "Model with 0M total params." in capsys.readouterr().out
    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    out = capsys.readouterr().out.splitlines()
    total, largest = 64_000 + 64 * 64 + 64, 64_000
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, 2, 1, True, True, True)
    assert out[4] == f" {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1"
