"""Error-compensated 1-bit all-reduce (DeepSpeed's ``compressed_allreduce``), on Gloo and NCCL alike.

Every rank holds a flat buffer ``x`` padded to ``padded_numel(n, world)`` and two error buffers that
persist across calls (error feedback)::

    worker:  c = x + worker_error;  s = ||c|| / sqrt(len(c));  worker_error = c - s * sign(c)
             sign bits of c (zero counts as +1), 8 per byte, cut into ``world`` chunks
             -> all-to-all: rank r receives every rank's chunk r;  all-gather of the scales s
    server:  (chunk r)  m = sum_k sign_k * s_k / world + server_error
             t = ||m|| / sqrt(len(m));  server_error = m - t * sign(m)
             -> all-gather of the chunk's sign bits and of t
    result:  chunk k of the output = t_k * sign_k(received)

On the wire each rank sends ``n/8`` bytes of signs twice plus ``world`` scales twice, against ``4n``
bytes of message (``8n`` of ring volume) for an fp32 all-reduce: 1/32 of the volume. Sizes are padded
as DeepSpeed pads them (a multiple of ``world * lcm(world, 8)``), so every chunk holds whole bytes.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .backend import Group, get_world_size
from .collectives import _nbytes, _run, all_gather
from .recoverable import resolve

_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)  # numpy.packbits order: first element in the high bit


def padded_numel(numel: int, world: int) -> int:
    """DeepSpeed's corrected size: ``numel`` rounded up to a multiple of ``world * lcm(world, 8)``."""
    unit = world * (world * 8 // math.gcd(world, 8))
    return numel + (-numel) % unit


def error_buffers(numel: int, world: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (worker_error, server_error) for a buffer of ``numel`` elements."""
    padded = padded_numel(numel, world)
    return (torch.zeros(padded, dtype=torch.float32, device=device),
            torch.zeros(padded // world, dtype=torch.float32, device=device))


def signs(x: torch.Tensor) -> torch.Tensor:
    """+1 where ``x >= 0`` (zero included, as DeepSpeed's ``sign().add(1).bool()``), -1 elsewhere."""
    return (x >= 0).to(x.dtype).mul_(2.0).sub_(1.0)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Bit ``x >= 0`` of each element, 8 per uint8 (``x.numel()`` must be a multiple of 8)."""
    assert x.numel() % 8 == 0, f"pack_signs needs a multiple of 8 elements, got {x.numel()}"
    bits = (x.reshape(-1, 8) >= 0).to(torch.uint8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=x.device)
    return (bits * weights).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: float32 +-1, 8 per byte."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    bits = (packed.reshape(-1, 1) & weights) != 0
    return bits.to(torch.float32).mul_(2.0).sub_(1.0).reshape(-1)


def scale_of(x: torch.Tensor) -> torch.Tensor:
    """``||x|| / sqrt(len(x))``: the magnitude that, times the signs, best approximates ``x`` in L2."""
    return torch.linalg.vector_norm(x) / math.sqrt(x.numel())


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: Group | None = None) -> None:
    """Equal chunks: rank r's chunk k lands as chunk r of rank k's ``output`` (counted by the logger)."""
    if get_world_size(group) == 1:
        output.copy_(input)
        return
    n = _nbytes(input)
    _run("all_to_all", group, n, n, False, lambda: dist.all_to_all_single(output, input, group=resolve(group)))


@torch.no_grad()
def compressed_all_reduce(buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                          group: Group | None = None) -> torch.Tensor:
    """The 1-bit average of ``buffer`` over ``group``; returns a new tensor of ``buffer``'s shape.

    ``worker_error`` (``padded_numel`` elements) and ``server_error`` (its ``1/world``) are updated in
    place. An empty buffer only zeroes the errors (as DeepSpeed). ``buffer`` is not modified.
    """
    world = get_world_size(group)
    numel = buffer.numel()
    if numel == 0:
        worker_error.zero_()
        server_error.zero_()
        return buffer.clone()
    padded = worker_error.numel()
    if padded != padded_numel(numel, world) or server_error.numel() != padded // world:
        raise ValueError(f"error buffers of {padded} and {server_error.numel()} elements do not fit a buffer of "
                         f"{numel} at world {world}: make them with error_buffers({numel}, {world})")
    x = torch.zeros(padded, dtype=torch.float32, device=buffer.device)
    x[:numel].copy_(buffer.reshape(-1))
    x.add_(worker_error)
    scale = scale_of(x)
    worker_error.copy_(x - scale * signs(x))

    chunk = padded // world
    sent = pack_signs(x)  # world chunks of chunk/8 bytes, in rank order
    got = torch.empty_like(sent)
    all_to_all(got, sent, group)
    scales = torch.empty(world, dtype=torch.float32, device=buffer.device)
    all_gather(scales, scale.reshape(1).to(torch.float32), group)

    server = server_average(unpack_signs(got).view(world, chunk), scales, world)
    server.add_(server_error)
    server_scale = scale_of(server)
    server_error.copy_(server - server_scale * signs(server))

    gathered = torch.empty(world * chunk // 8, dtype=torch.uint8, device=buffer.device)
    all_gather(gathered, pack_signs(server), group)
    server_scales = torch.empty(world, dtype=torch.float32, device=buffer.device)
    all_gather(server_scales, server_scale.reshape(1).to(torch.float32), group)

    out = unpack_signs(gathered).view(world, chunk).mul_(server_scales.view(world, 1)).reshape(-1)
    return out[:numel].to(buffer.dtype).reshape(buffer.shape)


def server_average(sign_rows: torch.Tensor, scales: torch.Tensor, world: int) -> torch.Tensor:
    """Average of the ranks' compressed chunks: ``sum_k sign_rows[k] * scales[k] / world``."""
    return sign_rows.mul(scales.mul(1.0 / world).view(-1, 1)).sum(0)
