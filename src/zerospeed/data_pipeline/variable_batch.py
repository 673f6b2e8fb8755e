"""Dynamic batching (DeepSpeed's ``data_sampling/variable_batch_size_and_lr.py``): micro-batches packed by
sequence length up to a token budget, grouped into batches whose sample count sets the learning rate.

The packing, for ``k`` micro-batches that must share a size (``k = effective_batch_size`` under a pipeline,
else ``k = 1``), walks the samples in the picking order and, from each start ``s``, keeps the *last* end
``e`` in ``s+k, s+2k, ... < n`` for which the ``k`` interleaved slices ``samples[s+b:e:k]`` are all valid
micro-batches (``min_batch_size <= count <= max_batch_size`` and tokens ``<= max_tokens``)::

    samples  a b c d e f g h ...      k = 2, start s = 0, end e = 6
    slices   a . c . e .   -> micro-batch 0
             . b . d . f   -> micro-batch 1

Then ``s = e``; a start with no valid end stops the packing (so, as in DeepSpeed, the last sample is
never packed: the ends stop before ``n``). The micro-batches are cut to a multiple of
``effective_batch_size`` and every ``effective_batch_size`` of them make one batch; its sample count is
what the learning rate is scaled by (``variable_lr.py``). Sequence lengths are non-negative, so a slice
that went over ``max_tokens`` or ``max_batch_size`` stays over: the walk stops there instead of trying
every end.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, DistributedSampler

_log = logging.getLogger("zerospeed.data_pipeline")

MicroBatch = tuple[int, list[int]]  # (batch id, sample ids)


def _ordered(seqlens: Sequence[int], ids: Sequence[int] | None, order: str, seed: int | None) -> list[tuple[Any, Any]]:
    """(length, sample id) pairs in the picking order: as given, shuffled by ``random.Random(seed)``, or
    ascending by (length, id)."""
    if order not in ("dataloader", "random", "seqlen"):
        raise ValueError(f"sequence_picking_order must be 'dataloader', 'random' or 'seqlen', got {order!r}")
    pairs = (list(zip(seqlens, range(len(seqlens)))) if ids is None
             else list(zip(np.asarray(seqlens)[list(ids)], ids)))
    if order == "random":
        random.Random(seed).shuffle(pairs)
    elif order == "seqlen":
        pairs.sort()
    return pairs


def _drop_too_long(pairs: list[tuple[Any, Any]], max_tokens: int) -> list[tuple[Any, Any]]:
    too_long = [i for v, i in pairs if v > max_tokens]
    if too_long:
        _log.warning("Data indices %s ignored as metrics exceed %s.", too_long, max_tokens)
        return [p for p in pairs if p[0] <= max_tokens]
    return pairs


def _last_valid_end(pairs: list[tuple[Any, Any]], start: int, k: int, max_tokens: int, min_bs: int | None,
                    max_bs: int | None) -> int:
    """The last end ``e`` (``start+k, start+2k, ... < len(pairs)``) whose ``k`` slices are all valid, or
    ``start`` when none is. Every slice holds ``(e - start) / k`` samples; slice ``b`` grows by
    ``pairs[e-k+b]`` when ``e`` moves on by ``k``."""
    tokens = [0] * k
    best, end = start, start + k
    while end < len(pairs):
        for b in range(k):
            tokens[b] += pairs[end - k + b][0]
        count = (end - start) // k
        if (max_bs and count > max_bs) or max(tokens) > max_tokens:
            break  # only grows from here
        if not (min_bs and count < min_bs):
            best = end
        end += k
    return best


def pack_microbatches(pairs: list[tuple[Any, Any]], max_tokens: int, min_batch_size: int | None,
                      max_batch_size: int | None, k: int) -> list[list[tuple[Any, Any]]]:
    """The greedy packing of the module docstring: a list of micro-batches of (length, id) pairs."""
    if any(v < 0 for v, _ in pairs):
        raise ValueError("dynamic batching: sequence lengths must be non-negative")
    out: list[list[tuple[Any, Any]]] = []
    start = 0
    while start < len(pairs):
        end = _last_valid_end(pairs, start, k, max_tokens, min_batch_size, max_batch_size)
        if end == start:
            break
        out += [pairs[start + b:end:k] for b in range(k)]
        start = end
    return out


def batch_by_seqlens(seqlens: Sequence[int], max_tokens: int, sequence_ids_per_mb: Sequence[int] | None = None,
                     min_batch_size: int = 1, max_batch_size: int | None = None,
                     sequence_picking_order: str = "dataloader", effective_batch_size: int = 1,
                     required_microbatches_of_same_size: bool = False, verbose: bool = False,
                     seed: int | None = None) -> tuple[list[MicroBatch], list[int], list[Any]]:
    """DeepSpeed's ``batch_by_seqlens``: ``(microbatch_ids, batch_sizes, batch_max_seqlens)``, where
    ``microbatch_ids`` holds ``(batch id, sample ids)`` per micro-batch, ``batch_sizes`` the samples of
    each batch of ``effective_batch_size`` micro-batches and ``batch_max_seqlens`` its longest sample.
    ``sequence_ids_per_mb`` restricts the samples to those ids."""
    pairs = _drop_too_long(_ordered(seqlens, sequence_ids_per_mb, sequence_picking_order, seed), max_tokens)
    k = effective_batch_size if required_microbatches_of_same_size else 1
    mbs = pack_microbatches(pairs, max_tokens, min_batch_size, max_batch_size, k)
    if len(mbs) < effective_batch_size:
        raise ValueError(f"dynamic batching: {len(mbs)} micro-batches packed, fewer than the {effective_batch_size} "
                         "of one batch (train_batch_size): not enough samples, or max_tokens too small")
    mbs = mbs[:len(mbs) - len(mbs) % effective_batch_size]
    microbatch_ids: list[MicroBatch] = []
    batch_sizes: list[int] = []
    batch_max_seqlens: list[Any] = []
    for batch_id in range(len(mbs) // effective_batch_size):
        group = mbs[batch_id * effective_batch_size:(batch_id + 1) * effective_batch_size]
        batch_sizes.append(sum(len(mb) for mb in group))
        batch_max_seqlens.append(max(v for mb in group for v, _ in mb))
        microbatch_ids += [(batch_id, [i for _, i in mb]) for mb in group]
        if verbose:
            _log.info("Batch id %d: %d micro-batches, %d sequences; tokens per micro-batch %s; ids %s", batch_id,
                      len(group), batch_sizes[-1], [sum(v for v, _ in mb) for mb in group],
                      [[i for _, i in mb] for mb in group])
    return microbatch_ids, batch_sizes, batch_max_seqlens


class VariableBatchCollate:
    """The loader's collate: the dataset's samples of each micro-batch id, padded to the batch's longest
    sample when asked (pipelines need one shape), flattened and handed to the user's collate. A class (not a
    closure) so loader workers can pickle it."""

    def __init__(self, dataset: Any, batch_max_seqlens: Sequence[Any], collate_fn: Callable[[list[Any]], Any] | None,
                 pad_to_batch_max: bool, sample_padding_fn: Callable[[Any, Any], Any] | None) -> None:
        if pad_to_batch_max and sample_padding_fn is None:
            raise ValueError("required_microbatches_of_same_seqlen needs sample_padding_fn(sample, max_seqlen)")
        self.dataset, self.batch_max_seqlens = dataset, batch_max_seqlens
        self.collate_fn, self.pad, self.padding_fn = collate_fn, pad_to_batch_max, sample_padding_fn

    def __call__(self, microbatches: list[MicroBatch]) -> Any:
        samples: list[Any] = []
        for batch_id, ids in microbatches:
            data = [self.dataset[i] for i in ids]
            if self.pad:
                longest = self.batch_max_seqlens[batch_id]
                if any(len(s) > longest for s in data):
                    raise ValueError(f"batch {batch_id}: a sample is longer than the batch's max seqlen {longest}")
                data = [self.padding_fn(s, longest) for s in data]  # type: ignore[misc]
            samples += data
        return self.collate_fn(samples) if self.collate_fn else samples


def dataloader_for_variable_batch_size(dataset: Any, microbatch_ids: list[MicroBatch], batch_max_seqlens: Sequence[Any],
                                       dataloader_rank: int = 0, dataloader_batch_size: int = 1,
                                       dataloader_num_replicas: int = 1, dataloader_collate_fn: Any = None,
                                       dataloader_num_workers: int = 2, dataloader_pin_memory: bool = False,
                                       required_microbatches_of_same_seqlen: bool = False,
                                       sample_padding_fn: Any = None) -> tuple[DataLoader, dict[str, Any]]:
    """A loader over the micro-batch ids: replica ``r`` takes micro-batches ``r, r + R, ...`` (a
    ``DistributedSampler`` without shuffling), ``dataloader_batch_size`` of them per step. Returns the loader
    and DeepSpeed's ``deepspeed_io`` keyword arguments for the same."""
    sampler = DistributedSampler(microbatch_ids, num_replicas=dataloader_num_replicas, rank=dataloader_rank,
                                 shuffle=False, drop_last=False)
    collate = VariableBatchCollate(dataset, batch_max_seqlens, dataloader_collate_fn,
                                   required_microbatches_of_same_seqlen, sample_padding_fn)
    loader = DataLoader(microbatch_ids, batch_size=dataloader_batch_size, sampler=sampler,
                        num_workers=dataloader_num_workers, collate_fn=collate, pin_memory=dataloader_pin_memory)
    io_kwargs = {"dataset": microbatch_ids, "batch_size": dataloader_batch_size, "pin_memory": dataloader_pin_memory,
                 "data_sampler": sampler, "collate_fn": collate, "num_local_io_workers": dataloader_num_workers}
    return loader, io_kwargs
