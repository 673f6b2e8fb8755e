"""Comet monitor (optional extra ``zerospeed[comet]``): one experiment on rank 0, each metric logged at most
once per ``samples_log_interval`` samples (DeepSpeed's ``CometMonitor``: the step of an event is the engine's
``global_samples``, and a name is logged on its first event and then whenever ``samples_log_interval``
samples have passed since it was last logged)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...config.monitoring import CometConfig
from .base import Event, Monitor, check_event, import_optional, writes_here


def import_comet() -> Any:
    return import_optional("comet_ml", "comet", "pip install zerospeed[comet]")


class SampleIntervalGate:
    """Per metric name: the first event passes, then one whenever ``interval`` samples have passed since the
    last one that passed."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._last: dict[str, int] = {}

    def passes(self, name: str, samples: int) -> bool:
        last = self._last.get(name)
        if last is not None and samples - last < self.interval:
            return False
        self._last[name] = samples
        return True


class CometMonitor(Monitor):
    """``comet_ml.start(...)`` with the section's keys; ``experiment.log_metric(name, value, step=samples)``.
    A disabled one (or one off rank 0) keeps ``enabled`` / ``samples_log_interval`` and starts no experiment."""

    def __init__(self, config: CometConfig, rank: int | None = None) -> None:
        self.enabled = config.enabled
        self.samples_log_interval = config.samples_log_interval
        self._gate = SampleIntervalGate(config.samples_log_interval)
        self.experiment: Any = None
        if not writes_here(self.enabled, rank):
            return
        comet_ml = import_comet()
        self.experiment = comet_ml.start(api_key=config.api_key, project=config.project, workspace=config.workspace,
                                         experiment_key=config.experiment_key, mode=config.mode, online=config.online)
        if config.experiment_name is not None:
            self.experiment.set_name(config.experiment_name)

    def write_events(self, events: Sequence[Event]) -> None:
        if self.experiment is None:
            return
        for event in events:
            name, value, samples = check_event(event)
            if self._gate.passes(name, samples):
                self.experiment.log_metric(name, value, step=samples)

    def close(self) -> None:
        if self.experiment is not None:
            self.experiment.end()
            self.experiment = None
