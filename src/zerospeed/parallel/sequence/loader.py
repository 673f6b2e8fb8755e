"""Sequence sharding of data-loader batches (DeepSpeed's ``UlyssesSPDataLoaderAdapter``), and the loss
average over a sequence group.

The ranks of a sequence group each draw a batch from their own loader; the adapter gathers the P batches
and hands them out one per iteration, every rank getting its ``seq/P`` slice of the same sample::

    iteration i (of P per refill):   rank r gets  batch_from_rank[i][:, r*c:(r+1)*c]     (c = seq/P)

Labels are shifted before slicing (``shift_labels[t] = labels[t+1]``, -100 after the last token), so the
last position of one rank predicts the first token of the next rank's slice and no rank needs its
neighbour's data. ``position_ids`` are sliced with the tokens and keep their global values.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from ... import comm

__all__ = ["UlyssesSPDataLoaderAdapter", "sequence_mean_loss"]


class UlyssesSPDataLoaderAdapter:
    """``UlyssesSPDataLoaderAdapter(dl, sp_rank, sp_group, sp_world_size, device)``: iterate it instead of
    ``dl``. Each batch is a dict of ``[batch, seq, ...]`` tensors with ``input_ids``, ``position_ids`` and
    ``labels`` (other keys are sliced too; non-tensors are copied); ``labels`` become ``shift_labels``."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> UlyssesSPDataLoaderAdapter:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts afresh, as in DeepSpeed
            raise
        for key in ("input_ids", "position_ids", "labels"):
            if key not in batch:
                raise ValueError(f"Ulysses sequence parallelism needs '{key}' in every batch (position_ids keep "
                                 "each token's global position after sharding: torch.arange(seq_len) per sample)")
        seq = batch["input_ids"].shape[1]
        for key, value in batch.items():
            if torch.is_tensor(value) and (value.dim() < 2 or value.shape[1] != seq):
                raise ValueError(f"'{key}' has shape {tuple(value.shape)}; every tensor must be [batch, {seq}, ...] "
                                 f"like input_ids {tuple(batch['input_ids'].shape)}")
        gathered = [dict() for _ in range(self.sp_world_size)]  # type: list[dict[str, Any]]
        for key, value in batch.items():
            parts = _gather(value, self.sp_group, self.sp_world_size)
            for r, part in enumerate(parts):
                gathered[r][key] = part
        for sample in gathered:
            self.micro_batches.append(self._shard(sample))

    def _shard(self, sample: dict[str, Any]) -> dict[str, Any]:
        seq = sample["input_ids"].shape[1]
        if seq % self.sp_world_size:
            raise ValueError(f"sequence length {seq} is not divisible by sequence_parallel_size {self.sp_world_size}: "
                             "pad the batch to a multiple")
        chunk = seq // self.sp_world_size
        labels = sample.pop("labels")
        sample["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        lo = chunk * self.sp_rank
        return {k: v[:, lo:lo + chunk].contiguous().to(self.device) if torch.is_tensor(v) else v
                for k, v in sample.items()}


def _gather(value: Any, group: Any, world: int) -> list[Any]:
    """Every rank's ``value`` (tensors of the same dtype and trailing shape; lengths along dim 1 may differ)."""
    if world == 1:
        return [value]
    if not torch.is_tensor(value):
        return comm.all_gather_object(value, group)
    lengths = [row[0] for row in comm.exchange_ints([value.shape[1]], group)]
    longest = max(lengths)
    t = value.to(comm.device_for_backend(group))
    if t.shape[1] < longest:  # pad along the sequence to the longest, trim after the gather
        pad = torch.zeros(t.shape[0], longest - t.shape[1], *t.shape[2:], dtype=t.dtype, device=t.device)
        t = torch.cat([t, pad], dim=1)
    out = torch.empty(world * t.numel(), dtype=t.dtype, device=t.device)
    comm.all_gather(out, t.contiguous().view(-1), group)
    return [block.view(t.shape)[:, :n].to(value.device) for block, n in zip(out.chunk(world), lengths)]


class _SequenceMean(torch.autograd.Function):
    """Forward: ``sum_r loss_r * n_r / sum_r n_r`` over the group. Backward: ``P * n_r / N`` to this rank's
    loss, what ``torch.distributed.nn.functional.all_gather`` of the losses gives (DeepSpeed's recipe); the
    engine then averages gradients over every rank, so the result is the unsharded gradient."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, count: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        weighted = loss.detach().float() * count.float() if int(count) > 0 else torch.zeros((), device=loss.device)
        both = torch.stack([weighted, count.float().to(weighted.device)]).to(comm.device_for_backend(group))
        comm.all_reduce(both, group=group)
        ctx.scale = comm.get_world_size(group) * float(count) / max(float(both[1]), 1.0)
        return (both[0] / both[1].clamp(min=1.0)).to(loss.dtype).to(loss.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return grad * ctx.scale, None, None


def sequence_mean_loss(loss: torch.Tensor, num_tokens: int | torch.Tensor, group: Any) -> torch.Tensor:
    """The mean loss over a sequence group's tokens, from each rank's mean ``loss`` over its ``num_tokens``
    (e.g. the labels that are not -100); the same value on every rank, equal to the unsharded loss."""
    count = num_tokens if torch.is_tensor(num_tokens) else torch.tensor(num_tokens)
    out = _SequenceMean.apply(loss, count.detach(), group)
    assert isinstance(out, torch.Tensor)
    return out
