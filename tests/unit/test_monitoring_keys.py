"""The ``comet`` monitor (DeepSpeed's ``CometMonitor``, run in comet_ml's offline mode, or its clear error when
the package is absent), the ``timers.throughput`` switches and ``log_level``, as config and as behaviour."""

from __future__ import annotations

import glob
import importlib.util
import json
import socket
import sys
import zipfile

import pytest

from zerospeed.config import ConfigError, load_config
from zerospeed.profiling.monitor import build_monitors
from zerospeed.profiling.monitor.comet import SampleIntervalGate
from zerospeed.profiling.throughput import ThroughputTimer

HAVE_COMET = importlib.util.find_spec("comet_ml") is not None


def test_sample_interval_gate_is_deepspeeds_events_log_scheduler() -> None:
    gate = SampleIntervalGate(8)
    passed = [(n, s) for s in (4, 8, 12, 16, 20, 28) for n in ("loss", "lr") if gate.passes(n, s)]
    assert passed == [("loss", 4), ("lr", 4), ("loss", 12), ("lr", 12), ("loss", 20), ("lr", 20), ("loss", 28),
                      ("lr", 28)]


def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline means offline: any name lookup or connection fails here, before it leaves the machine; comet_ml's
    error reporting, host and environment logging and framework patching are switched off."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(f"network refused in this test: {args[:2]!r}")

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # comet_ml installs its own on import: put ours back
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    for key, value in {"COMET_ERROR_TRACKING_ENABLE": "false", "COMET_AUTO_LOG_ENV_HOST": "false",
                       "COMET_AUTO_LOG_ENV_DETAILS": "false", "COMET_DISABLE_AUTO_LOGGING": "1"}.items():
        monkeypatch.setenv(key, value)


def test_comet_monitor_logs_events_offline_or_names_the_missing_package(tmp_path, monkeypatch) -> None:
    cfg = load_config({"train_batch_size": 1, "comet": {"enabled": True, "online": False, "project": "zs",
                                                         "experiment_name": "run-1", "samples_log_interval": 8}})
    if not HAVE_COMET:
        with pytest.raises(ConfigError, match=r"comet.enabled.*comet_ml"):
            build_monitors(comet=cfg.comet)
        return
    _no_network(monkeypatch)
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path))
    assert not build_monitors(comet=cfg.comet, rank=1).enabled  # only rank 0 starts an experiment
    monitor = build_monitors(comet=cfg.comet)
    for samples in (4, 8, 12, 16, 20):
        monitor.write_events([("Train/Samples/train_loss", samples / 10, samples)])
    monitor.close()
    (archive,) = glob.glob(str(tmp_path / "*.zip"))
    with zipfile.ZipFile(archive) as z:
        messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines() if line.strip()]
        experiment = json.loads(z.read("experiment.json"))
    metrics = [m["payload"]["metric"] for m in messages if m.get("type") == "metric_msg"]
    assert [(m["metricName"], m["metricValue"], m["step"]) for m in metrics] == [
        ("Train/Samples/train_loss", 0.4, 4), ("Train/Samples/train_loss", 1.2, 12),
        ("Train/Samples/train_loss", 2.0, 20)]
    assert experiment["project_name"] == "zs"
    others = {m["payload"]["key"]: m["payload"]["value"] for m in messages if m.get("type") == "log_other"}
    assert others.get("Name") == "run-1"  # experiment_name


def test_timers_and_log_level_config() -> None:
    cfg = load_config({"train_batch_size": 1, "timers": {"throughput": {"enabled": False, "synchronized": False}},
                       "log_level": "ERROR"})
    assert (cfg.timers.throughput.enabled, cfg.timers.throughput.synchronized, cfg.log_level) == (False, False,
                                                                                                 "error")
    default = load_config({"train_batch_size": 1})
    assert (default.timers.throughput.enabled, default.timers.throughput.synchronized) == (True, True)
    assert default.log_level is None
    with pytest.raises(ConfigError, match="log_level"):
        load_config({"train_batch_size": 1, "log_level": "loud"})
    with pytest.raises(ConfigError, match="throughput"):
        load_config({"train_batch_size": 1, "timers": {"througput": {}}})


def test_throughput_timer_switches() -> None:
    synced: list[int] = []
    on = ThroughputTimer(4, synchronize=lambda: synced.append(1))
    off = ThroughputTimer(4, enabled=False, synchronize=lambda: synced.append(2))
    unsynced = ThroughputTimer(4, synchronized=False, synchronize=lambda: synced.append(3))
    for timer in (on, off, unsynced):
        timer.read_clock()
        for _ in range(3):
            timer.record_step(0.5)
    assert synced == [1]  # only the enabled, synchronized timer waits for the device
    assert on.global_step_count == 3 and on.avg_samples_per_sec() == pytest.approx(8.0)
    assert off.global_step_count == 0 and off.avg_samples_per_sec() == float("-inf")  # DeepSpeed's disabled timer
