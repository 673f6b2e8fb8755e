"""Dynamic batching's front door: a loader of packed micro-batches and the LR schedule scaled to them,
from arguments or from an engine's ``data_efficiency.data_sampling.dynamic_batching`` section.

As in DeepSpeed, ``initialize()`` does not switch it on by itself: the training script calls
``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(dataset, engine, ...)`` and then
iterates the loader (each step of it is ``train_micro_batch_size_per_gpu`` packed micro-batches) and steps
the returned schedule after each optimizer step (or sets it as ``engine.lr_scheduler``, which the engine
steps at each boundary; then the config must not name a scheduler of its own, or it is stepped twice).

The sequence lengths come from ``dataset_seqlens``, else from ``<metrics_path>/seqlen/seqlen_sample_to_metric``
(DeepSpeed's data-analyzer output), else they are computed with ``batch_seqlens_fn`` over the collated
dataset and written there for the next run.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import comm
from .indexed import fit_int_dtype, read_indexed, write_indexed
from .variable_batch import batch_by_seqlens, dataloader_for_variable_batch_size
from .variable_lr import lr_scheduler_for_variable_batch_size

ANALYZER_CHUNK = 1024  # samples per call of batch_seqlens_fn (DeepSpeed's analyzer batch)


def get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset: Any, dataset_seqlens: Sequence[int], max_tokens: int, effective_batch_size: int,
        dataset_filter_ids: Sequence[int] | None = None, lr_scaling_method: str = "linear", min_batch_size: int = 1,
        max_batch_size: int | None = None, sequence_picking_order: str = "dataloader", dataloader_batch_size: int = 1,
        dataloader_rank: int = 0, dataloader_num_replicas: int = 1, dataloader_num_workers: int = 0,
        dataloader_collate_fn: Any = None, dataloader_pin_memory: bool = False, lr_scheduler_or_optimizer: Any = None,
        required_microbatches_of_same_size: bool = False, required_microbatches_of_same_seqlen: bool = False,
        sample_padding_fn: Any = None, verbose: bool = False,
        seed: int | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """``(dataloader, lr_scheduler, deepspeed_io_kwargs)``; the LR's reference batch size is
    ``effective_batch_size`` (micro-batches per batch, DeepSpeed's choice)."""
    microbatch_ids, batch_sizes, batch_max_seqlens = batch_by_seqlens(
        dataset_seqlens, max_tokens, sequence_ids_per_mb=dataset_filter_ids, min_batch_size=min_batch_size,
        max_batch_size=max_batch_size, sequence_picking_order=sequence_picking_order,
        effective_batch_size=effective_batch_size,
        required_microbatches_of_same_size=required_microbatches_of_same_size, verbose=verbose, seed=seed)
    loader, io_kwargs = dataloader_for_variable_batch_size(
        dataset, microbatch_ids, batch_max_seqlens, dataloader_rank=dataloader_rank,
        dataloader_batch_size=dataloader_batch_size, dataloader_num_replicas=dataloader_num_replicas,
        dataloader_collate_fn=dataloader_collate_fn, dataloader_num_workers=dataloader_num_workers,
        dataloader_pin_memory=dataloader_pin_memory,
        required_microbatches_of_same_seqlen=required_microbatches_of_same_seqlen, sample_padding_fn=sample_padding_fn)
    scheduler = lr_scheduler_for_variable_batch_size(effective_batch_size, batch_sizes, loader,
                                                     lr_scheduler_or_optimizer, lr_scaling_method, verbose)
    return loader, scheduler, io_kwargs


def dataset_seqlens_from(dataset: Any, metrics_path: str | None, batch_seqlens_fn: Callable[[Any], Any] | None,
                         collate_fn: Any, write: bool) -> np.ndarray:
    """The per-sample sequence lengths from the metric files, or computed (and written when ``write``)."""
    if metrics_path is None:
        raise ValueError("dynamic batching needs dataset_seqlens, or dynamic_batching.metrics_path in the config")
    prefix = os.path.join(metrics_path, "seqlen", "seqlen_sample_to_metric")
    if not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
        if batch_seqlens_fn is None:
            raise ValueError(f"no sequence-length metric at {prefix}.idx/.bin: pass dataset_seqlens or "
                             "batch_seqlens_fn (it is then computed and written there)")
        values = _computed_seqlens(dataset, batch_seqlens_fn, collate_fn)
        if write:
            _write_atomically(prefix, values)
        return values
    values = np.array([int(item[0]) for item in read_indexed(prefix)], dtype=np.int64)
    if len(values) != len(dataset):
        raise ValueError(f"{prefix}: {len(values)} sequence lengths for a dataset of {len(dataset)} samples; if the "
                         "dataset changed, delete the metrics_path folder")
    return values


def _write_atomically(prefix: str, values: np.ndarray) -> None:
    """Both files under temporary names, then moved into place (``.idx`` last): another rank that sees both
    reads whole files, one that sees only ``.bin`` computes the lengths itself."""
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    write_indexed(tmp, [np.array([v]) for v in values], fit_int_dtype(int(values.min()), int(values.max())))
    os.replace(tmp + ".bin", prefix + ".bin")
    os.replace(tmp + ".idx", prefix + ".idx")


def _computed_seqlens(dataset: Any, fn: Callable[[Any], Any], collate_fn: Any) -> np.ndarray:
    out: list[int] = []
    for lo in range(0, len(dataset), ANALYZER_CHUNK):
        samples = [dataset[i] for i in range(lo, min(lo + ANALYZER_CHUNK, len(dataset)))]
        values = np.asarray(fn(collate_fn(samples) if collate_fn else samples)).reshape(-1)
        if len(values) != len(samples):
            raise ValueError(f"batch_seqlens_fn returned {len(values)} values for {len(samples)} samples")
        out += [int(v) for v in values]
    return np.array(out, dtype=np.int64)


def get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset: Any, engine: Any, dataset_seqlens: Sequence[int] | None = None,
        dataset_filter_ids: Sequence[int] | None = None, dataloader_collate_fn: Any = None,
        sample_padding_fn: Any = None, batch_seqlens_fn: Any = None) -> tuple[Any, Any, dict[str, Any]]:
    """The same, configured from ``engine``: its ``dynamic_batching`` section, batch sizes, data-parallel
    group, ``data_sampling.num_workers`` / ``pin_memory``, ``data_efficiency.seed``, and its schedule (or
    optimizer) as the LR base. A pipeline engine packs micro-batches of one size, padded to one length."""
    de = engine.config.data_efficiency
    batching = de.data_sampling.dynamic_batching
    if not batching.enabled:
        raise ValueError("Dynamic batching is not enabled in the config "
                         "(data_efficiency.data_sampling.dynamic_batching.enabled)")
    if dataset_seqlens is None:
        dataset_seqlens = dataset_seqlens_from(dataset, batching.metrics_path, batch_seqlens_fn, dataloader_collate_fn,
                                               write=comm.get_rank() == 0)
    # DeepSpeed's path (served by _aliases), read at call time: the engine stack is built by then
    pipe_engine = importlib.import_module("zerospeed.runtime.pipe.engine").PipelineEngine
    group = engine.data_parallel_group
    pipelined = isinstance(engine, pipe_engine)
    return get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset, dataset_seqlens, batching.max_tokens, engine.train_batch_size(), dataset_filter_ids=dataset_filter_ids,
        lr_scaling_method=batching.lr_scaling_method, min_batch_size=batching.min_batch_size,
        max_batch_size=batching.max_batch_size, sequence_picking_order=batching.sequence_picking_order,
        dataloader_batch_size=engine.train_micro_batch_size_per_gpu(), dataloader_rank=comm.get_rank(group),
        dataloader_num_replicas=comm.get_world_size(group), dataloader_num_workers=de.data_sampling.num_workers,
        dataloader_collate_fn=dataloader_collate_fn, dataloader_pin_memory=de.data_sampling.pin_memory,
        lr_scheduler_or_optimizer=engine.lr_scheduler or engine.optimizer,
        required_microbatches_of_same_size=pipelined, required_microbatches_of_same_seqlen=pipelined,
        sample_padding_fn=sample_padding_fn, verbose=batching.verbose, seed=de.seed)
