"""ZeRO++ qwZ: block-wise symmetric int8 all-gather of weights (DeepSpeed's ``zero_quantized_weights``).

Each rank quantises its flat shard in ``groups`` blocks: ``q = clamp(round(x * 128 / absmax), -128, 127)``
per block (DeepSpeed's symmetric 8-bit kernel), all-gathers the int8 blocks and the fp32 per-block
``absmax / 128`` scales, and dequantises every rank's chunk into the compute dtype. The number of blocks
follows DeepSpeed's rule (``CUDAQuantizer.quantize``): start from ``ceil(n / 8000)``, step up until
``n % (8 * groups) == 0``, then double while ``n % (16 * groups) == 0`` and the block exceeds 8000. A shard
whose size is not a multiple of 8 (DeepSpeed asserts) is zero-padded to one here.

Bytes: ``n`` int8 per rank (1/4 of fp32, 1/2 of bf16/fp16) plus ``4 * groups`` of scales.

The ``fp8`` codec (``fp8.allgather_fp8``) uses the same blocks with e4m3 codes, ``scale = absmax / 448``
per block: the same bytes, a floating-point grid (relative error at most 2^-4 within a block's range
instead of int8's uniform steps), sent as uint8.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch

from .backend import Group, get_world_size
from .collectives import Handle, all_gather

TARGET_GROUP_SIZE = 8000


@lru_cache(maxsize=1024)
def quant_groups(numel: int) -> int:
    """DeepSpeed's block count for a flat tensor of ``numel`` (a multiple of 8) elements."""
    if numel <= 0 or numel % 8:
        raise ValueError(f"quantised weights need a positive multiple of 8 elements, got {numel}")
    groups = math.ceil(numel / TARGET_GROUP_SIZE)
    while groups < numel and numel % (8 * groups) != 0:
        groups += 1
    while numel % (8 * groups * 2) == 0 and numel / groups > TARGET_GROUP_SIZE:
        groups *= 2
    return groups


def quantize_int8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, fp32 scales ``absmax / 128`` per block) of the flat ``x`` cut into ``groups`` blocks."""
    blocks = x.detach().float().reshape(groups, -1)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / 128.0, torch.ones_like(absmax))
    q = torch.round(blocks / scale).clamp_(-128, 127).to(torch.int8)
    return q.reshape(-1), scale.reshape(-1)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    groups = scales.numel()
    return (q.reshape(groups, -1).float() * scales.reshape(groups, 1)).reshape(-1).to(dtype)


E4M3_MAX = 448.0


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes viewed as uint8, fp32 scales ``absmax / 448`` per block) of the flat ``x``."""
    blocks = x.detach().float().reshape(groups, -1)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / E4M3_MAX, torch.ones_like(absmax))
    codes = (blocks / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(-1).view(torch.uint8), scale.reshape(-1)


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    groups = scales.numel()
    codes = q.view(torch.float8_e4m3fn).reshape(groups, -1).float()
    return (codes * scales.reshape(groups, 1)).reshape(-1).to(dtype)


CODECS = {"int8": (quantize_int8, dequantize_int8, torch.int8), "fp8": (quantize_fp8, dequantize_fp8, torch.uint8)}


class QuantizedGather:
    """An in-flight quantised all-gather: ``wait()`` completes it and writes the dequantised ``out``."""

    def __init__(self, out: torch.Tensor, send: torch.Tensor, group: Group | None, async_op: bool,
                 codec: str = "int8") -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown weight-gather codec {codec!r}; expected one of {sorted(CODECS)}")
        quantize, self.dequantize, wire = CODECS[codec]
        self.out, self.world = out, get_world_size(group)
        self.n = send.numel()
        self.padded = self.n + (-self.n) % 8
        flat = send.reshape(-1)
        if self.padded != self.n:
            flat = torch.cat([flat, flat.new_zeros(self.padded - self.n)])
        self.groups = quant_groups(self.padded)
        q, scales = quantize(flat, self.groups)
        self.q_all = torch.empty(self.world * self.padded, dtype=wire, device=send.device)
        self.s_all = torch.empty(self.world * self.groups, dtype=torch.float32, device=send.device)
        self._keep = (q, scales)
        self.handles: list[Any] = [all_gather(self.q_all, q, group, async_op=async_op),
                                   all_gather(self.s_all, scales, group, async_op=async_op)]
        if not async_op:
            self.wait()

    def wait(self) -> None:
        for h in self.handles:
            if isinstance(h, Handle):
                h.wait()
        self.handles = []
        if self._keep is None:
            return
        self._keep = None
        rows = [self.dequantize(self.q_all.view(self.world, -1)[r], self.s_all.view(self.world, -1)[r],
                                self.out.dtype)[: self.n] for r in range(self.world)]
        self.out.view(self.world, self.n).copy_(torch.stack(rows))


def quantized_all_gather(out: torch.Tensor, send: torch.Tensor, group: Group | None = None,
                         async_op: bool = False, codec: str = "int8") -> QuantizedGather | None:
    """``all_gather`` with int8 (or ``codec="fp8"``: e4m3) blocks on the wire; the result is dequantised
    into ``out`` on ``wait()``."""
    op = QuantizedGather(out, send, group, async_op, codec)
    return op if async_op else None
