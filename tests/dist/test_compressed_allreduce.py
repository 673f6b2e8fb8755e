"""The 1-bit compressed all-reduce equals a one-process simulation of DeepSpeed's algorithm, bit for bit.

The simulation below works on signs as floats (no bit packing, no collectives): each rank compresses its
error-compensated buffer, each rank's server chunk averages the compressed chunks, adds its own error and is
compressed again. Several calls in a row, so the error buffers carry over (error feedback), at world 2 and 4,
with a size that needs DeepSpeed's padding, a 2-D buffer and an empty one.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from zerospeed.comm.compressed import pack_signs, padded_numel, unpack_signs
from zerospeed.testing import run_distributed

SHAPES = [(37,), (37,), (6, 9), (37,), (0,)]  # the same 37-element buffer three times: its errors carry over


def data(call: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * call + rank)
    x = torch.randn(SHAPES[call], generator=g)
    if x.numel():
        x.view(-1)[0] = 0.0  # zero compresses as +1
    return x


def run() -> dict[str, Any]:
    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    errors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    out = []
    comm.COMMS_LOGGER.reset()
    for call, shape in enumerate(SHAPES):
        numel = math.prod(shape)
        we, se = errors.setdefault(numel, comm.error_buffers(numel, world))
        x = data(call, rank)
        y = comm.compressed_all_reduce(x, we, se, group=comm.world_group())
        assert torch.equal(x, data(call, rank)), "the input buffer is left as it was"
        out.append((y.clone(), we.clone(), se.clone()))
    stats = comm.COMMS_LOGGER.snapshot()
    return {"out": out, "a2a_bytes": stats["all_to_all"].bytes, "ag_bytes": stats["all_gather"].bytes}


def simulate_call(xs: list[torch.Tensor], we: list[torch.Tensor], se: list[torch.Tensor]) -> torch.Tensor:
    """One call of the 1-bit all-reduce on every rank's ``xs[r]``, in one process: updates the ranks' worker
    errors ``we`` and server errors ``se`` (lists, replaced in place) and returns the average every rank gets."""
    world, shape, n = len(xs), xs[0].shape, xs[0].numel()
    padded = padded_numel(n, world)
    chunk = padded // world
    sgn, scale = [], []
    for r in range(world):
        c = torch.cat([xs[r].reshape(-1), torch.zeros(padded - n)]) + we[r]
        s = torch.linalg.vector_norm(c) / math.sqrt(padded)
        sign = torch.where(c >= 0, 1.0, -1.0)
        we[r] = c - s * sign
        sgn.append(sign)
        scale.append(s)
    scales = torch.stack(scale)
    t_list, t_sign = [], []
    for r in range(world):
        rows = torch.stack([sgn[k][r * chunk:(r + 1) * chunk] for k in range(world)])
        m = rows.mul(scales.mul(1.0 / world).view(-1, 1)).sum(0) + se[r]
        t = torch.linalg.vector_norm(m) / math.sqrt(chunk)
        sign = torch.where(m >= 0, 1.0, -1.0)
        se[r] = m - t * sign
        t_list.append(t)
        t_sign.append(sign)
    return torch.cat([t_list[r] * t_sign[r] for r in range(world)])[:n].reshape(shape)


def fresh_errors(n: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    padded = padded_numel(n, world)
    return [torch.zeros(padded)] * world, [torch.zeros(padded // world)] * world


def simulate(world: int) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """results[call][rank] = (output, worker_error, server_error), one process, plain tensor ops."""
    errors: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    results = []
    for call, shape in enumerate(SHAPES):
        n = math.prod(shape)
        we, se = errors.setdefault(n, fresh_errors(n, world))
        if n == 0:
            errors[n] = fresh_errors(n, world)
            results.append([(torch.zeros(shape), errors[n][0][r], errors[n][1][r]) for r in range(world)])
            continue
        full = simulate_call([data(call, r) for r in range(world)], we, se)
        results.append([(full, we[r].clone(), se[r].clone()) for r in range(world)])
    return results


def test_pack_signs_is_numpy_packbits_order() -> None:
    x = torch.tensor([1.0, -1.0, 0.0, -0.0, -2.0, 3.0, -1.0, -1.0, -5.0, 0, 0, 0, 0, 0, 0, -1])
    assert pack_signs(x).tolist() == [0b10110100, 0b01111110]
    assert torch.equal(unpack_signs(pack_signs(x)), torch.where(x >= 0, 1.0, -1.0))


def test_padding_is_deepspeeds() -> None:
    # world * lcm(world, 8): 16 at world 2, 32 at 4, 72 at 3, 64 at 8
    assert [padded_numel(37, w) for w in (1, 2, 3, 4, 8)] == [40, 48, 72, 64, 64]
    assert padded_numel(0, 4) == 0 and padded_numel(64, 4) == 64


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_all_reduce_equals_simulation(world: int) -> None:
    results = run_distributed(run, world, timeout=60)
    expected = simulate(world)
    for rank, r in enumerate(results):
        for call, (got, want) in enumerate(zip(r["out"], expected)):
            for what, a, b in zip(("output", "worker_error", "server_error"), got, want[rank]):
                assert torch.equal(a, b), f"call {call} rank {rank}: {what} differs"
        # every rank gets the same result, and error feedback changes the second call's result
        assert all(torch.equal(r["out"][c][0], results[0]["out"][c][0]) for c in range(len(SHAPES)))
    assert results[0]["out"][1][1].abs().sum() > 0 and results[0]["out"][1][2].abs().sum() > 0
    # bytes counted by the comms logger: signs are padded/8 bytes per all-to-all, 1/world of that per rank
    # and gathered back; four scales gathered per call (worker and server)
    sizes = [padded_numel(math.prod(s), world) for s in SHAPES if math.prod(s)]
    assert results[0]["a2a_bytes"] == sum(p // 8 for p in sizes)
    assert results[0]["ag_bytes"] == sum(p // 8 + 2 * 4 * world for p in sizes)

