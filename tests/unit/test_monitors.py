"""Monitors: events written by rank 0 read back from TensorBoard and CSV files; W&B optional."""

from __future__ import annotations

import csv
import sys
import types

import pytest

from zerospeed.config.errors import ConfigError
from zerospeed.config.monitoring import CsvMonitorConfig, TensorBoardConfig, WandbConfig
from zerospeed.profiling.monitor import MonitorMaster, build_monitors
from zerospeed.profiling.monitor import wandb as wandb_monitor

EVENTS = [("Train/Samples/train_loss", 2.5, 1), ("Train/Samples/lr", 1e-3, 1)]


def test_tensorboard_events_read_back(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = TensorBoardConfig(enabled=True, output_path=str(tmp_path), job_name="job")
    monitor = build_monitors(tensorboard=cfg)
    assert monitor.enabled
    monitor.write_events(EVENTS)
    monitor.write_events([("Train/Samples/train_loss", 1.5, 2)])
    monitor.close()
    acc = EventAccumulator(str(tmp_path / "job"))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("Train/Samples/train_loss")]
    assert loss == [(1, 2.5), (2, 1.5)]
    assert acc.Scalars("Train/Samples/lr")[0].value == pytest.approx(1e-3)


def test_csv_one_file_per_metric_in_deepspeed_layout(tmp_path) -> None:
    cfg = CsvMonitorConfig(enabled=True, output_path=str(tmp_path), job_name="run1")
    monitor = build_monitors(csv_monitor=cfg)
    monitor.write_events(EVENTS)
    monitor.write_events([("Train/Samples/train_loss", 1.25, 2)])
    loss_file = tmp_path / "run1" / "Train_Samples_train_loss.csv"
    with open(loss_file, newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [["step", "train_loss"], ["1", "2.5"], ["2", "1.25"]]
    # a new monitor on the same folder appends without repeating the header
    build_monitors(csv_monitor=cfg).write_events([("Train/Samples/train_loss", 1.0, 3)])
    with open(loss_file, newline="") as f:
        assert [r[0] for r in csv.reader(f)] == ["step", "1", "2", "3"]
    with open(tmp_path / "run1" / "Train_Samples_lr.csv", newline="") as f:
        assert list(csv.reader(f))[1] == ["1", "0.001"]


def test_only_rank0_writes(tmp_path) -> None:
    csv_cfg = CsvMonitorConfig(enabled=True, output_path=str(tmp_path), job_name="r")
    tb_cfg = TensorBoardConfig(enabled=True, output_path=str(tmp_path), job_name="t")
    monitor = build_monitors(tb_cfg, csv_cfg, WandbConfig(enabled=True), rank=1)
    assert not monitor.enabled
    monitor.write_events(EVENTS)
    monitor.close()
    assert list(tmp_path.iterdir()) == []


def test_disabled_sections_build_nothing() -> None:
    monitor = build_monitors(TensorBoardConfig(), CsvMonitorConfig(), WandbConfig())
    assert isinstance(monitor, MonitorMaster) and not monitor.enabled and monitor.monitors == []
    monitor.write_events(EVENTS)


def test_malformed_events_are_rejected(tmp_path) -> None:
    monitor = build_monitors(csv_monitor=CsvMonitorConfig(enabled=True, output_path=str(tmp_path)))
    with pytest.raises(ValueError, match=r"\(name, value, step\)"):
        monitor.write_events([("loss", 1.0)])
    with pytest.raises(ValueError, match="name"):
        monitor.write_events([(3, 1.0, 1)])


def test_wandb_missing_names_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(ConfigError, match="wandb.enabled"):
        build_monitors(wandb=WandbConfig(enabled=True))


def test_wandb_logs_each_event_at_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    logged: list[tuple[dict, int]] = []
    inits: list[dict] = []
    fake = types.SimpleNamespace(
        init=lambda **kw: inits.append(kw) or types.SimpleNamespace(finish=lambda: None),
        log=lambda data, step=None: logged.append((data, step)),
    )
    monkeypatch.setattr(wandb_monitor, "import_wandb", lambda: fake)
    monitor = build_monitors(wandb=WandbConfig(enabled=True, team="t", group="g", project="p"))
    monitor.write_events(EVENTS)
    monitor.close()
    assert inits == [{"project": "p", "group": "g", "entity": "t"}]
    assert logged == [({"Train/Samples/train_loss": 2.5}, 1), ({"Train/Samples/lr": 1e-3}, 1)]


def test_monitors_built_directly_keep_deepspeed_attributes(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's tests build each monitor from its section and read the section's fields back off it; a
    disabled one, or one off rank 0, opens no writer, run or experiment."""
    from zerospeed.config.monitoring import CometConfig
    from zerospeed.profiling.monitor import CometMonitor, TensorBoardMonitor, WandbMonitor
    from zerospeed.profiling.monitor import comet as comet_monitor

    tb = TensorBoardMonitor(TensorBoardConfig(enabled=True, output_path=str(tmp_path), job_name="test"))
    assert (tb.enabled, tb.output_path, tb.job_name) == (True, str(tmp_path), "test") and tb.writer is not None
    tb.close()
    off = TensorBoardMonitor(TensorBoardConfig())
    defaults = TensorBoardConfig()
    assert (off.enabled, off.output_path, off.job_name) == (False, defaults.output_path, defaults.job_name)
    assert off.writer is None
    off.write_events(EVENTS)
    monkeypatch.setattr(wandb_monitor, "import_wandb", lambda: pytest.fail("a disabled W&B monitor imports wandb"))
    wb = WandbMonitor(WandbConfig(enabled=False, group="g", team="t", project="p"))
    assert (wb.enabled, wb.group, wb.team, wb.project) == (False, "g", "t", "p")
    monkeypatch.setattr(comet_monitor, "import_comet", lambda: pytest.fail("comet started off rank 0"))
    cm = CometMonitor(CometConfig(enabled=True, samples_log_interval=42), rank=1)
    assert (cm.enabled, cm.samples_log_interval, cm.experiment) == (True, 42, None)
    cm.write_events(EVENTS)
    cm.close()
