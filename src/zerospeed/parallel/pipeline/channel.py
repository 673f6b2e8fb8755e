"""Moving activations and gradients between neighbouring stages.

Activations are a tensor or a tuple of tensors of any rank, shape and dtype (floating tensors that need a
gradient, and non-differentiable ones such as masks). The receiver must allocate before it can post a
receive, so each (peer, tag) channel starts with a handshake (one for training, one for evaluation, whose
requires-grad flags differ): the sender first sends the shapes, dtypes and requires-grad flags (a length,
then an int64 description), then the data; later transfers send the data alone. With
``dynamic_shape=True`` every transfer is preceded by a one-element header that is 0 when the description
is unchanged and its length when a new description follows, so shapes may change from micro-batch to
micro-batch and the description is re-sent only when they do.

Gradients need no description: the receiver allocates them like the outputs it sent. Sends are posted
asynchronously (``batch_isend_irecv``) and completed at the end of the batch. A receive completes at once,
and when the schedule holds another receive on the same channel in this batch (``prefetch_next``, shapes
static) the next one is posted right away, so its data arrives while this stage computes instead of
when it asks for it.
Tag ``2 * chunk`` carries activations into model chunk ``chunk``, ``2 * chunk + 1`` gradients into it.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import comm

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]
_DTYPE_ID = {d: i for i, d in enumerate(DTYPES)}


def as_tuple(x: Any) -> tuple[torch.Tensor, ...]:
    if torch.is_tensor(x):
        return (x,)
    if isinstance(x, (tuple, list)) and all(torch.is_tensor(t) for t in x):
        return tuple(x)
    raise ValueError(f"a pipeline stage must pass a tensor or a tuple of tensors to the next, got {type(x).__name__}"
                     + ("" if not isinstance(x, (tuple, list)) else f" of {[type(t).__name__ for t in x]}"))


def describe(tensors: tuple[torch.Tensor, ...]) -> list[int]:
    """[count, then per tensor: dtype id, requires_grad, ndim, *shape]."""
    out = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPE_ID:
            raise ValueError(f"pipeline activations of dtype {t.dtype} are not supported (use one of {DTYPES})")
        out += [_DTYPE_ID[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    return out


def parse(meta: list[int]) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    specs, pos = [], 1
    for _ in range(meta[0]):
        dtype, rg, ndim = DTYPES[meta[pos]], bool(meta[pos + 1]), meta[pos + 2]
        specs.append((dtype, rg, tuple(meta[pos + 3:pos + 3 + ndim])))
        pos += 3 + ndim
    return specs


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What goes on the wire: contiguous, detached; bool as uint8 (not every backend sends bool)."""
    t = t.detach()
    return (t.to(torch.uint8) if t.dtype == torch.bool else t).contiguous()


class Channels:
    """This stage's p2p state: the descriptions agreed per channel, sends in flight, bytes moved."""

    def __init__(self, group: Any, device: torch.device, dynamic_shape: bool = False) -> None:
        self.group = group
        self.device = device
        self.dynamic_shape = dynamic_shape
        # keyed by (peer, tag, grad mode): training and evaluation agree on their own descriptions (the
        # requires-grad flags differ), and both sides of a channel are always in the same mode
        self.sent_meta: dict[tuple[int, int, bool], list[int]] = {}
        self.recv_meta: dict[tuple[int, int, bool], list[int]] = {}
        self.in_flight: list[tuple[comm.P2PHandle, list[torch.Tensor]]] = []
        # receives posted ahead, keyed by ("act", peer, tag, grad mode) or ("grad", peer, tag)
        self.prefetched: dict[tuple[Any, ...], tuple[comm.P2PHandle, list[torch.Tensor]]] = {}
        self.bytes_sent = 0
        self.bytes_received = 0
        self.received_ahead = 0  # receives whose data was posted for before the schedule asked for it

    def _post(self, ops: list[comm.P2P]) -> None:
        handle = comm.exchange(ops, self.group)
        self.in_flight.append((handle, [o.tensor for o in ops]))
        self.bytes_sent += sum(o.tensor.numel() * o.tensor.element_size() for o in ops)

    def _recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
        comm.exchange([comm.P2P("recv", t, peer, tag) for t in tensors], self.group).wait()
        self.bytes_received += sum(t.numel() * t.element_size() for t in tensors)

    def _take(self, key: tuple[Any, ...]) -> list[torch.Tensor] | None:
        """The buffers of a receive posted ahead on ``key``, completed (None when none was posted)."""
        item = self.prefetched.pop(key, None)
        if item is None:
            return None
        handle, bufs = item
        handle.wait()
        self.received_ahead += 1
        self.bytes_received += sum(t.numel() * t.element_size() for t in bufs)
        return bufs

    def _post_ahead(self, key: tuple[Any, ...], bufs: list[torch.Tensor], peer: int, tag: int) -> None:
        assert key not in self.prefetched, f"a receive is already posted ahead on {key}"
        handle = comm.exchange([comm.P2P("recv", t, peer, tag) for t in bufs], self.group)
        self.prefetched[key] = (handle, bufs)

    def send_activations(self, x: Any, peer: int, tag: int) -> None:
        tensors = as_tuple(x)
        meta = describe(tensors)
        ops: list[comm.P2P] = []
        key = (peer, tag, torch.is_grad_enabled())
        known = self.sent_meta.get(key)
        if self.dynamic_shape:
            changed = meta != known
            ops.append(comm.P2P("send", torch.tensor([len(meta) if changed else 0], dtype=torch.int64,
                                                     device=self.device), peer, tag))
        else:
            changed = known is None
            if not changed and meta != known:
                raise ValueError(f"stage output changed from {parse(known)} to {parse(meta)} after the first "
                                 "micro-batch; pass PipelineModule(..., dynamic_shape=True) to allow shapes to change")
            if changed:
                ops.append(comm.P2P("send", torch.tensor([len(meta)], dtype=torch.int64, device=self.device), peer, tag))
        if changed:
            ops.append(comm.P2P("send", torch.tensor(meta, dtype=torch.int64, device=self.device), peer, tag))
            self.sent_meta[key] = meta
        ops += [comm.P2P("send", _wire(t), peer, tag) for t in tensors]
        self._post(ops)

    def recv_activations(self, peer: int, tag: int, prefetch_next: bool = False) -> tuple[torch.Tensor, ...]:
        key = (peer, tag, torch.is_grad_enabled())
        bufs = self._take(("act", *key))
        if bufs is None:
            known = self.recv_meta.get(key)
            length = 0
            if self.dynamic_shape or known is None:
                header = torch.zeros(1, dtype=torch.int64, device=self.device)
                self._recv([header], peer, tag)
                length = int(header.item())
            if length:
                meta_t = torch.zeros(length, dtype=torch.int64, device=self.device)
                self._recv([meta_t], peer, tag)
                self.recv_meta[key] = meta_t.tolist()
            bufs = self._alloc(self.recv_meta[key])
            self._recv(bufs, peer, tag)
        specs = parse(self.recv_meta[key])
        if prefetch_next and not self.dynamic_shape:
            self._post_ahead(("act", *key), self._alloc(self.recv_meta[key]), peer, tag)
        out = []
        for (dt, rg, _), b in zip(specs, bufs):
            t = b.to(torch.bool) if dt == torch.bool else b
            out.append(t.requires_grad_(rg) if rg and t.is_floating_point() else t)
        return tuple(out)

    def _alloc(self, meta: list[int]) -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=torch.uint8 if dt == torch.bool else dt, device=self.device)
                for dt, _, shape in parse(meta)]

    def send_grads(self, grads: list[torch.Tensor], peer: int, tag: int) -> None:
        self._post([comm.P2P("send", _wire(g), peer, tag) for g in grads])

    def recv_grads(self, like: list[torch.Tensor], peer: int, tag: int, prefetch_next: bool = False) -> list[torch.Tensor]:
        def alloc() -> list[torch.Tensor]:
            return [torch.empty_like(t, memory_format=torch.contiguous_format).detach() for t in like]

        bufs = self._take(("grad", peer, tag))
        if bufs is None:
            bufs = alloc()
            self._recv(bufs, peer, tag)
        elif [(b.shape, b.dtype) for b in bufs] != [(t.shape, t.dtype) for t in like]:
            raise ValueError(f"gradients received ahead have shapes {[tuple(b.shape) for b in bufs]} but this "
                             f"micro-batch's outputs have {[tuple(t.shape) for t in like]}; pass "
                             "PipelineModule(..., dynamic_shape=True) when stage outputs change shape")
        if prefetch_next and not self.dynamic_shape:
            self._post_ahead(("grad", peer, tag), alloc(), peer, tag)
        return bufs

    def finish(self) -> None:
        """Complete every send still in flight (end of a batch)."""
        for handle, _ in self.in_flight:
            handle.wait()
        self.in_flight.clear()
        assert not self.prefetched, f"receives posted ahead but never used: {sorted(self.prefetched)}"
