"""TiledMLP's activation memory: the stack's peak *measured* (resident set high-water mark, reset per block, of a
forked child); what one MLP keeps for backward *accounted* (the storages autograd saves).

Each measurement runs in its own forked process with glibc told to serve every allocation over 64 KiB by
``mmap`` (``mallopt``), so a freed tensor leaves the resident set at once and the kernel's high-water mark
follows live tensor bytes; the garbage collector is run first and then paused, so garbage inherited from
the parent is not freed in the middle of a measurement. ``[seq, hidden]`` tensors every variant must hold (the input gradient) are
subtracted; what remains is activation memory.
"""

from __future__ import annotations

import ctypes
import gc
import os
import pickle

import pytest
import torch
from torch import nn

from zerospeed.parallel.sequence.tiled import TiledMLP
from zerospeed.profiling.memory import measure_memory

SEQ, HIDDEN, LAYERS, SHARDS = 16384, 64, 4, 4
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs") or not hasattr(os, "fork"),
                                reason="needs Linux's resettable peak RSS and fork")


def _mlp_fn(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mlp(x)


def _measure(shards: int) -> dict[str, int]:
    """In the child: peak of a 4-layer residual MLP stack's forward+backward, and what one MLP holds for backward."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    libc.mallopt(M_TRIM_THRESHOLD, 64 * 1024)
    gc.collect()  # garbage inherited from the parent (a long test session) must not be freed mid-measurement
    gc.disable()
    torch.set_num_threads(1)  # one allocation pattern, whatever the parent's thread settings
    torch.manual_seed(0)
    mlps = [nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))
            for _ in range(LAYERS)]

    def mlp(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return m(h) if shards == 1 else TiledMLP.apply(_mlp_fn, m, h, shards, None)

    x = torch.randn(1, SEQ, HIDDEN, requires_grad=True)
    grad = torch.randn(1, SEQ, HIDDEN)
    out: dict[str, int] = {}
    for _ in range(2):  # the first round warms up (first-touch of allocator and thread pools)
        x.grad = None
        for m in mlps:
            m.zero_grad(set_to_none=True)
        with measure_memory() as stack:
            h = x
            for m in mlps:
                h = h + mlp(m, h)
            h.backward(grad)
            del h
        out["stack_peak"] = stack.growth_bytes - x.grad.nbytes  # type: ignore[union-attr]
        held: dict[int, int] = {}  # accounted: the storages autograd keeps from forward to backward

        def keep(t: torch.Tensor) -> torch.Tensor:
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            y = mlp(mlps[0], x)
        out["held"] = sum(held.values())
        del y
    return out


def _in_child(shards: int) -> dict[str, int]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(read)
            os.write(write, pickle.dumps(_measure(shards)))
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and data, f"measuring child failed (status {status})"
    return pickle.loads(data)


def test_tiled_mlp_activation_memory_is_lower_by_the_shard_factor() -> None:
    plain, tiled = _in_child(1), _in_child(SHARDS)
    mib = {k: (plain[k] / 2**20, tiled[k] / 2**20) for k in plain}
    # Untiled, each MLP keeps its input and its [seq, 4*hidden] GELU input and output (4 + 2 x 16 MiB here) for
    # backward; tiled keeps only its input (the residual stream, shared), and recomputes one shard at a time.
    assert plain["held"] >= 24 * 2**20, mib
    assert tiled["held"] * SHARDS <= plain["held"], mib
    assert tiled["stack_peak"] * SHARDS <= plain["stack_peak"], mib
