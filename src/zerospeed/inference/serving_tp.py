"""Tensor parallelism for the serving engine: rank 0 plans and samples, every rank runs the sharded forward.

The scheduler, the requests and sampling live on rank 0 of the tensor-parallel group only, so the plans
cannot diverge. Before each forward rank 0 broadcasts the *batch plan* — the flat token ids and, per
chunk, ``(start, length, block table)`` — as two int64 tensors (a fixed 4-int header, then the payload).
Every rank, rank 0 included, then runs the same ragged forward over its own heads and its own paged KV
cache (same block ids on every rank; each rank's blocks hold its ``kv_heads / tp`` heads); the row-parallel
layers all-reduce their partial sums through ``comm``. Only rank 0 applies the (whole, replicated) LM head
and samples. The other ranks loop in ``run_worker`` until rank 0 sends ``stop``; an idle rank 0 sends a
heartbeat now and then so the workers' blocking broadcast never reaches the collective timeout. A ``WEIGHTS``
message (``update_weights`` between requests) carries the indices of the parameters whose full tensors rank 0
broadcasts next (see ``serving_weights``).
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm

from .kv_cache import RaggedBatch, SeqChunk

__all__ = ["PlanChannel", "STOP", "HEARTBEAT", "FORWARD", "WEIGHTS"]

STOP, FORWARD, HEARTBEAT, WEIGHTS = 0, 1, 2, 3


class PlanChannel:
    """Rank 0 -> the other ranks of ``group``: one message per forward (or a heartbeat / stop)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = comm.get_rank(group)
        self.size = comm.get_world_size(group)
        self.src = comm.global_rank_of(group, 0)
        self.device = comm.device_for_backend(group)
        self.closed = False

    def _send(self, kind: int, payload: list[int], counts: tuple[int, int] = (0, 0)) -> None:
        assert self.rank == 0, "only rank 0 of the tensor-parallel group sends plans"
        head = torch.tensor([kind, len(payload), *counts], dtype=torch.long, device=self.device)
        comm.broadcast(head, self.src, self.group)
        if payload:
            comm.broadcast(torch.tensor(payload, dtype=torch.long, device=self.device), self.src, self.group)

    def send_batch(self, ids: list[int], chunks: list[SeqChunk]) -> None:
        """The plan of one forward: ``[ids..., (start, length, nblocks, blocks...) per chunk]``."""
        payload = list(ids)
        for c in chunks:
            payload += [c.start, c.length, len(c.block_table), *c.block_table]
        self._send(FORWARD, payload, (len(ids), len(chunks)))

    def heartbeat(self) -> None:
        self._send(HEARTBEAT, [])

    def send_weights(self, indices: list[int]) -> None:
        """Announce a weight update: the ``state_dict`` indices whose full tensors are broadcast next."""
        self._send(WEIGHTS, list(indices), (len(indices), 0))

    def stop(self) -> None:
        if not self.closed:
            self._send(STOP, [])
            self.closed = True

    def receive(self) -> tuple[int, RaggedBatch | list[int] | None]:
        """The next message on a worker rank: ``(kind, batch)`` for ``FORWARD``, ``(kind, indices)`` for
        ``WEIGHTS``, ``(kind, None)`` otherwise."""
        head = torch.empty(4, dtype=torch.long, device=self.device)
        comm.broadcast(head, self.src, self.group)
        kind, n, num_ids, num_chunks = head.tolist()
        if kind not in (FORWARD, WEIGHTS):
            return kind, None
        payload = torch.empty(n, dtype=torch.long, device=self.device)
        if n:
            comm.broadcast(payload, self.src, self.group)
        flat = payload.tolist()
        if kind == WEIGHTS:
            return kind, flat
        chunks, at = [], num_ids
        for _ in range(num_chunks):
            start, length, nb = flat[at:at + 3]
            chunks.append(SeqChunk(tuple(flat[at + 3:at + 3 + nb]), start, length))
            at += 3 + nb
        return kind, RaggedBatch(payload[:num_ids].clone(), chunks)
