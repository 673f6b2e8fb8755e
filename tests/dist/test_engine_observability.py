"""Engine reporting: wall-clock breakdown, monitors written and read back, the flops profile with MFU."""

import contextlib
import csv
import io
import os

import torch
from torch import nn

import zerospeed
from zerospeed.testing import run_distributed


def _train(out_dir: str) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    config = {
        "train_micro_batch_size_per_gpu": 4, "steps_per_print": 2, "wall_clock_breakdown": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "tensorboard": {"enabled": True, "output_path": out_dir, "job_name": "tb"},
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "csv"},
        "flops_profiler": {"enabled": True, "profile_step": 2, "detailed": False},
        "comms_logger": {"enabled": True},
        "memory_breakdown": True,
    }
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        engine, *_ = zerospeed.initialize(model=model, config=config)
        for _ in range(4):
            loss = engine(torch.randn(4, 8)).pow(2).mean()
            engine.backward(loss)
            engine.step()
        engine.observer.close()
    return buf.getvalue()


def test_reports_and_monitors(tmp_path) -> None:
    out0, out1 = run_distributed(_train, 2, str(tmp_path))
    assert "step=2" in out0 and "step=4" in out0 and out1 == ""  # rank 0 prints, rank 1 stays quiet
    assert "forward" in out0 and "backward" in out0 and "comm (last step)" in out0
    assert "MFU" in out0 or "mfu" in out0.lower()
    assert "reduce_scatter" in out0 and "model-state bytes" in out0
    # CSV: one file per metric, a row per step
    loss_csv = [p for p in (tmp_path / "csv").rglob("*.csv") if "train_loss" in p.name]
    assert loss_csv, list(tmp_path.rglob("*"))
    rows = list(csv.reader(loss_csv[0].open()))
    assert len(rows) == 5  # header + 4 steps
    # TensorBoard: the loss scalar is readable
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_dirs = {os.path.dirname(p) for p in map(str, tmp_path.rglob("events.out.tfevents.*"))}
    assert event_dirs
    acc = EventAccumulator(event_dirs.pop())
    acc.Reload()
    assert len(acc.Scalars("Train/Samples/train_loss")) == 4
