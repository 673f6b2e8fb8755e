"""CSV monitor in DeepSpeed's layout: one file per metric, ``output_path/job_name/<name>.csv``.

The file name is the event name with ``/`` and spaces turned into ``_``; the header is ``step,<last part of
the name>``; each event appends one ``step,value`` row. A file that already exists from an earlier run is
appended to without a second header.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence

from ...config.monitoring import CsvMonitorConfig
from .base import Event, Monitor, check_event, writes_here


def csv_filename(name: str) -> str:
    return name.replace("/", "_").replace(" ", "_") + ".csv"


class CsvMonitor(Monitor):
    """Built from a ``csv_monitor`` section; its directory is made only when the section is enabled and on rank 0 (as in
    DeepSpeed, whose ``csvMonitor`` is this class's other name)."""

    def __init__(self, config: CsvMonitorConfig, rank: int | None = None) -> None:
        self.enabled = config.enabled
        self._writing = writes_here(config.enabled, rank)
        self.output_path = config.output_path
        self.job_name = config.job_name
        self.log_dir = os.path.join(config.output_path, config.job_name)
        if self._writing:
            os.makedirs(self.log_dir, exist_ok=True)

    def path_for(self, name: str) -> str:
        return os.path.join(self.log_dir, csv_filename(name))

    def write_events(self, events: Sequence[Event]) -> None:
        if not self._writing:
            return
        for event in events:
            name, value, step = check_event(event)
            path = self.path_for(name)
            new_file = not os.path.exists(path) or os.path.getsize(path) == 0
            with open(path, "a", newline="", encoding="utf-8") as f:
                writer = csv.writer(f)
                if new_file:
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([step, value])


csvMonitor = CsvMonitor  # DeepSpeed's name (deepspeed.monitor.csv_monitor)
