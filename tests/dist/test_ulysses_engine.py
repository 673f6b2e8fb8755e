"""sequence_parallel_size on the engine: DeepSpeed's group accessors and layout, batch sizes counted in
data-parallel replicas, and precise errors for sizes and combinations that do not fit."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from zerospeed import comm
from zerospeed.config import ConfigError
from zerospeed.parallel.sequence import initialize_sequence_parallel
from zerospeed.testing import run_distributed

CONFIG = {"train_batch_size": 4, "sequence_parallel_size": 2, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


def _ranks(group) -> list[int]:
    out = torch.zeros(comm.get_world_size(), dtype=torch.int64)
    out[comm.get_rank()] = 1
    comm.all_reduce(out, group=group)
    return out.nonzero().flatten().tolist()


def _groups() -> dict:
    engine, *_ = zerospeed.initialize(model=torch.nn.Linear(4, 4), config=CONFIG)
    return {"sp": _ranks(engine.get_sequence_parallel_group()), "dp": _ranks(engine.data_parallel_group),
            "seq_dp": _ranks(engine.seq_data_parallel_group), "sizes": (engine.sequence_parallel_size,
            engine.dp_world_size, engine.seq_dp_world_size), "micro": engine.train_micro_batch_size_per_gpu(),
            "dp_rank": engine.get_data_parallel_rank()}


def test_engine_exposes_deepspeeds_sequence_groups() -> None:
    out = run_distributed(_groups, 4)
    for rank, r in enumerate(out):
        assert r["sp"] == [rank - rank % 2, rank - rank % 2 + 1]  # sequence peers adjacent
        assert r["dp"] == [rank % 2, rank % 2 + 2]
        assert r["seq_dp"] == [0, 1, 2, 3]
        assert r["sizes"] == (2, 2, 4)
        assert r["micro"] == 2  # train_batch_size 4 over 2 data-parallel replicas
        assert r["dp_rank"] == rank // 2


def _bad(kind: str) -> str:
    try:
        if kind == "size":
            zerospeed.initialize(model=torch.nn.Linear(4, 4), config={**CONFIG, "sequence_parallel_size": 3})
        else:
            grid = initialize_sequence_parallel(2)
            zerospeed.initialize(model=torch.nn.Linear(4, 4), config={**CONFIG, "sequence_parallel_size": 4},
                                 mpu=grid)
    except (ValueError, ConfigError) as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("kind,words", [("size", "sequence_parallel_size 3 does not divide the world size 4"),
                                        ("mpu", "has a sequence group of 2")])
def test_sizes_that_do_not_fit_are_refused(kind: str, words: str) -> None:
    assert all(words in m for m in run_distributed(_bad, 4, kind)), words
