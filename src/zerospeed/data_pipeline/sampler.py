"""The curriculum data sampler (DeepSpeed's ``DeepSpeedDataSampler``): each global batch is drawn only from
samples whose metrics are within the current difficulties.

Per global batch (rank 0 decides, then broadcasts it to the data-parallel group):

1. the curriculum step advances; each metric's scheduler gives its difficulty;
2. when a difficulty moved, a new *cluster* is made: the samples that became eligible (a metric value in
   ``(previous, current]``, or for ``difficulty_type: percentile`` the next percentiles of the sorted index),
   shuffled; with several metrics, the samples eligible under all of them, minus earlier clusters;
3. the batch is drawn from the clusters in proportion to their sizes, read in order from each cluster (a
   cluster reshuffles when exhausted), and shuffled.

Clusters are written to ``data_cluster_path`` in DeepSpeed's indexed format (``cluster_<metric><value>``), so
a checkpoint stores only their names and read positions. Randomness is ``numpy.random.default_rng(seed)``
with DeepSpeed's draws, so the same config and index give DeepSpeed's sample order.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from .. import comm
from ..config.data_efficiency import CurriculumMetricConfig, DataEfficiencyConfig
from .curriculum_scheduler import CurriculumScheduler
from .indexed import fit_int_dtype, read_indexed, write_indexed

_log = logging.getLogger("zerospeed.data_pipeline")


class CurriculumSampler:
    """A batch sampler: yields this rank's sample ids of each micro-batch."""

    def __init__(self, config: DataEfficiencyConfig, one_epoch_total_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, data_parallel_group: Any,
                 gradient_accumulation_steps: int, global_rank: int, drop_last: bool = True) -> None:
        sampling = config.data_sampling
        cl = sampling.curriculum_learning
        if cl.data_cluster_path is None:
            raise ValueError("data_efficiency.data_sampling.curriculum_learning.data_cluster_path is required: the "
                             "sampler writes its data clusters there")
        self.one_epoch_total_samples = one_epoch_total_samples
        self.total_samples = one_epoch_total_samples * sampling.num_epochs
        self.index_dtype = fit_int_dtype(0, one_epoch_total_samples)
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank, self.data_parallel_size = data_parallel_rank, data_parallel_size
        self.data_parallel_group = data_parallel_group
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.global_batch_size = self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        self.is_source = comm.get_rank(data_parallel_group) == 0
        self._source = comm.global_rank_of(data_parallel_group, 0)
        self._device = comm.device_for_backend(data_parallel_group)
        self.global_rank = global_rank
        self.drop_last = drop_last
        self.np_rng = np.random.default_rng(config.seed)
        self.cluster_root = cl.data_cluster_path
        self.metrics: dict[str, CurriculumMetricConfig] = dict(cl.curriculum_metrics)
        self.curriculum_schedulers = {m: CurriculumScheduler(c) for m, c in self.metrics.items()}
        self.batch: list[int] = []
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.current_difficulties: dict[str, Any] = {}
        self.data_cluster_paths: list[str] = []
        self.data_cluster_current_position: list[int] = []
        self.data_clusters: list[np.ndarray] = []  # on the source rank only
        self.index_to_sample: dict[str, list[np.ndarray]] = {}
        self.index_to_metric: dict[str, list[np.ndarray]] = {}
        self._epoch_size: int | None = None
        if self.is_source:
            os.makedirs(self.cluster_root, exist_ok=True)
            for m, c in self.metrics.items():
                if c.clustering_type == "single_cluster":
                    continue
                if c.index_to_sample_path is None or (c.difficulty_type == "value" and c.index_to_metric_path is None):
                    raise ValueError(f"curriculum_metrics.{m}: index_to_sample_path (and index_to_metric_path for "
                                     "difficulty_type 'value') are required unless clustering_type is single_cluster")
                self.index_to_sample[m] = read_indexed(c.index_to_sample_path)
                if c.difficulty_type == "value":
                    assert c.index_to_metric_path is not None
                    self.index_to_metric[m] = read_indexed(c.index_to_metric_path)

    def __len__(self) -> int:
        return self.total_samples

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: dict[str, Any]) -> None:
        for metric, sched in self.curriculum_schedulers.items():
            if metric in schedule_func_dict:
                sched.set_custom_get_difficulty(schedule_func_dict[metric])

    # --- which samples a difficulty admits ------------------------------------------------------------
    def _by_value(self, metric: str, start: float, end: float) -> np.ndarray | None:
        rows = [np.copy(s) for s, v in zip(self.index_to_sample[metric], self.index_to_metric[metric])
                if start < v[0] <= end]
        return np.concatenate(rows) if rows else None

    def _by_percentile(self, metric: str, start: int, end: int) -> np.ndarray | None:
        rows = self.index_to_sample[metric]
        if self._epoch_size is None:
            self._epoch_size = sum(len(r) for r in rows)
        top = self.metrics[metric].max_difficulty
        per = self._epoch_size // top
        lo, hi = per * start, (self._epoch_size if end == top else per * end)
        out, seen = [], 0
        for r in rows:
            if seen + len(r) > lo:
                out.append(np.copy(r[max(0, lo - seen):(len(r) if seen + len(r) <= hi else hi - seen)]))
            seen += len(r)
            if seen >= hi:
                break
        return np.concatenate(out) if out else None

    def _admitted(self, metric: str, start: Any, end: Any) -> np.ndarray | None:
        if self.metrics[metric].difficulty_type == "value":
            return self._by_value(metric, start, end)
        return self._by_percentile(metric, start, end)

    def _cluster_name(self) -> str:
        return "cluster" + "".join(f"_{m}{self.current_difficulties[m]}" for m in self.curriculum_schedulers)

    def _new_cluster(self, previous: dict[str, Any]) -> None:
        name = self._cluster_name()
        path = os.path.join(self.cluster_root, name)
        made = False
        if self.is_source:
            cluster = self._make_cluster(previous)
            made = cluster is not None and len(cluster) > 0
            if made:
                assert cluster is not None
                self.np_rng.shuffle(cluster)
                write_indexed(path, [cluster], self.index_dtype)
                self.data_clusters.append(cluster)
            else:
                _log.info("new data cluster (difficulties %s) has no matched data thus skipped",
                          self.current_difficulties)
        flag = torch.tensor([1 if self.is_source and made else 0], device=self._device)
        comm.broadcast(flag, src=self._source, group=self.data_parallel_group)
        if int(flag.item()):
            self.data_cluster_paths.append(name)
            self.data_cluster_current_position.append(0)

    def _make_cluster(self, previous: dict[str, Any]) -> np.ndarray | None:
        scheduled = [m for m in self.metrics if self.metrics[m].clustering_type != "single_cluster"]
        everything = np.arange(self.one_epoch_total_samples, dtype=self.index_dtype)
        if len(scheduled) > 1:  # eligible under every metric, minus what earlier clusters hold
            cluster = None
            for m in self.curriculum_schedulers:
                floor = float("-inf") if self.metrics[m].difficulty_type == "value" else 0
                part = everything if m not in scheduled else self._admitted(m, floor, self.current_difficulties[m])
                part = np.array([], dtype=self.index_dtype) if part is None else part
                cluster = part if cluster is None else np.intersect1d(cluster, part, assume_unique=True)
            for old in self.data_clusters:
                cluster = np.setdiff1d(cluster, old, assume_unique=True)
            return cluster
        cluster = everything if not self.data_clusters else None
        for m in scheduled:
            cluster = self._admitted(m, previous[m], self.current_difficulties[m])
        return cluster

    # --- drawing batches ------------------------------------------------------------------------------
    def _from_cluster(self, cidx: int, n: int) -> list[int]:
        start = self.data_cluster_current_position[cidx]
        samples = [int(x) for x in self.data_clusters[cidx][start:start + n]]
        self.data_cluster_current_position[cidx] += n
        if len(samples) < n:  # exhausted: reshuffle (and rewrite) the cluster, continue from its start
            rest = n - len(samples)
            cluster = np.copy(self.data_clusters[cidx])
            self.np_rng.shuffle(cluster)
            write_indexed(os.path.join(self.cluster_root, self.data_cluster_paths[cidx]), [cluster], self.index_dtype)
            self.data_clusters[cidx] = cluster
            samples += [int(x) for x in cluster[:rest]]
            self.data_cluster_current_position[cidx] = rest
        return samples

    def get_next_global_batch(self) -> None:
        self.curriculum_step += 1
        changed, previous = False, {}
        for m, sched in self.curriculum_schedulers.items():
            nxt = sched.update_difficulty(self.curriculum_step)
            changed |= m not in self.current_difficulties or nxt != self.current_difficulties[m]
            previous[m] = self.current_difficulties.get(
                m, float("-inf") if self.metrics[m].difficulty_type == "value" else 0)
            self.current_difficulties[m] = nxt
        if changed:
            self._new_cluster(previous)
        batch = torch.full((self.global_batch_size,), -1, dtype=torch.long, device=self._device)
        if self.is_source:
            sizes = [len(c) for c in self.data_clusters]
            picks = self.np_rng.choice(len(sizes), self.global_batch_size, replace=True,
                                       p=[s / sum(sizes) for s in sizes])
            chosen: list[int] = []
            for cidx, n in enumerate(np.bincount(picks, minlength=len(sizes))):
                chosen += self._from_cluster(cidx, int(n))
            self.np_rng.shuffle(chosen)
            batch[:len(chosen)] = torch.tensor(chosen, dtype=torch.long)
        comm.broadcast(batch, src=self._source, group=self.data_parallel_group)
        self.batch = batch[batch != -1].tolist()

    def _start_end(self, batch_len: int) -> tuple[int, int]:
        start = round(self.data_parallel_rank * batch_len / self.data_parallel_size)
        return start, round((self.data_parallel_rank + 1) * batch_len / self.data_parallel_size)

    def __iter__(self) -> Iterator[list[int]]:
        while self.consumed_samples <= self.total_samples:
            if not self.batch:
                self.get_next_global_batch()
            current = self.batch[:self.micro_batch_times_data_parallel_size]
            self.batch = self.batch[self.micro_batch_times_data_parallel_size:]
            if len(current) == self.micro_batch_times_data_parallel_size or (current and not self.drop_last):
                start, end = self._start_end(len(current))
                yield current[start:end]
                self.consumed_samples += len(current)

    # --- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"batch": list(self.batch), "consumed_samples": self.consumed_samples,
                "curriculum_step": self.curriculum_step, "current_difficulties": dict(self.current_difficulties),
                "data_cluster_paths": list(self.data_cluster_paths),
                "data_cluster_current_position": list(self.data_cluster_current_position),
                "np_rng_state": self.np_rng.bit_generator.state,
                "schedulers": {m: s.state_dict() for m, s in self.curriculum_schedulers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch = list(state["batch"])
        self.consumed_samples = int(state["consumed_samples"])
        self.curriculum_step = int(state["curriculum_step"])
        self.current_difficulties = dict(state["current_difficulties"])
        self.data_cluster_paths = [p.split("/")[-1] for p in state["data_cluster_paths"]]
        self.data_cluster_current_position = list(state["data_cluster_current_position"])
        self.np_rng.bit_generator.state = state["np_rng_state"]
        for m, s in state.get("schedulers", {}).items():
            self.curriculum_schedulers[m].load_state_dict(s)
        if self.is_source:
            self.data_clusters = [np.array(read_indexed(os.path.join(self.cluster_root, name))[0])
                                  for name in self.data_cluster_paths]


class CurriculumDataLoader(DataLoader):
    """The training loader under curriculum sampling: batches from a ``CurriculumSampler`` (``data_sampler``,
    as DeepSpeed's loader names it); its state for checkpoints is the sampler's."""

    def __init__(self, dataset: Any, sampler: CurriculumSampler, collate_fn: Any, num_workers: int,
                 pin_memory: bool) -> None:
        super().__init__(dataset, batch_sampler=sampler, collate_fn=collate_fn, num_workers=num_workers,
                         pin_memory=pin_memory)
        self.data_sampler = sampler

    def state_dict(self) -> dict[str, Any]:
        return self.data_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data_sampler.load_state_dict(state)


def build_curriculum_dataloader(config: DataEfficiencyConfig, dataset: Any, micro_batch: int, dp_rank: int,
                                dp_size: int, dp_group: Any, gas: int, collate_fn: Any = None,
                                drop_last: bool = False) -> CurriculumDataLoader:
    """``deepspeed_io`` under ``data_efficiency.data_sampling.curriculum_learning`` (num_workers, pin_memory
    from ``data_sampling``)."""
    sampler = CurriculumSampler(config, len(dataset), micro_batch, dp_rank, dp_size, dp_group, gas,
                                comm.get_rank(), drop_last=drop_last)
    sampling = config.data_sampling
    return CurriculumDataLoader(dataset, sampler, collate_fn, sampling.num_workers, sampling.pin_memory)
