"""ZeRO++ qgZ: a reduce-scatter that moves int4 blocks by two all-to-alls, inside the node then across nodes.

The input holds ``world`` equal chunks in rank order (chunk ``r`` is rank ``r``'s share); ranks are
numbered node-major (``comm/hierarchy.py``: ``M`` nodes of ``L`` ranks). DeepSpeed's scheme
(``all_to_all_quant_reduce``, its ``swizzle_quant`` and ``quantized_reduction`` kernels):

1. swizzle the chunks from ``[node][local]`` to ``[local][node]`` order, so local peer ``j``'s part is the
   ``M`` chunks of the ranks with local index ``j``; quantise to symmetric int4 in blocks of ``block``
   elements (``q = clamp(round(x * 8 / absmax), -8, 7)``, two values per byte, one fp32 scale per block);
2. all-to-all inside the node: each rank receives its ``M`` chunks from each of the ``L`` local ranks;
   dequantise and sum over them (the node's partial sums), quantise again;
3. all-to-all across nodes (the ranks with the same local index): each rank receives its own chunk's
   partial sum from every node; dequantise and sum: the reduction of its chunk over all ranks.

Bytes per rank: ``n / 2`` int4 inside the node and ``n / (2 L)`` across nodes (``n`` input elements),
plus ``4`` bytes per block at each level, against ``2 n`` for an fp16 reduce-scatter. Collectives are
logged as ``intra:all_to_all`` and ``inter:all_to_all``. Unlike DeepSpeed's kernel, which leaves the sum
over the node's ranks divided only by the number of nodes, the result here is the plain sum (the caller
scales it, as after a reduce-scatter).

LoCo (``zeropp_loco_param``, arXiv 2407.04480): with error buffers ``e`` (one per level, kept by the caller
between steps) each level sends ``Q(x + e)`` instead of ``Q(x)`` and then updates
``e <- beta * e + (1 - beta) * (x + e - deQ(Q(x + e)))``: what quantisation dropped is sent later, averaged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .backend import Group, get_world_size
from .collectives import _nbytes, _run
from .hierarchy import Hierarchy
from .recoverable import resolve


def quantize_int4(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 with two int4 values per byte, fp32 scale ``absmax / 8`` per block) of the flat ``x``."""
    if block < 2 or block % 2 or x.numel() % block:
        raise ValueError(f"int4 blocks need an even block size dividing the input ({x.numel()} by {block})")
    blocks = x.detach().float().reshape(-1, block)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / 8.0, torch.ones_like(absmax))
    q = (torch.round(blocks / scale).clamp_(-8, 7) + 8).to(torch.uint8).reshape(-1)
    return q[0::2] | (q[1::2] << 4), scale.reshape(-1)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``quantize_int4``'s output."""
    lo = (packed & 0xF).to(torch.float32) - 8.0
    hi = (packed >> 4).to(torch.float32) - 8.0
    q = torch.stack([lo, hi], dim=1).reshape(scales.numel(), -1)
    return (q * scales.reshape(-1, 1)).reshape(-1)


def _all_to_all(level: str, out: torch.Tensor, inp: torch.Tensor, group: Group) -> None:
    if get_world_size(group) == 1:
        out.copy_(inp)
        return
    n = _nbytes(inp)
    _run(f"{level}:all_to_all", group, n, n, False,
         lambda: dist.all_to_all_single(out, inp, group=resolve(group)))


def _compensated(values: torch.Tensor, block: int, err: torch.Tensor | None,
                 beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 of ``values``; with LoCo's error buffer ``err`` (flat, updated in place), of ``values + err``."""
    if err is None:
        return quantize_int4(values.reshape(-1), block)
    x = values.reshape(-1).float() + err
    q, s = quantize_int4(x, block)
    err.mul_(beta).add_(x - dequantize_int4(q, s), alpha=1.0 - beta)
    return q, s


def _exchange(level: str, values: torch.Tensor, block: int, parts: int, group: Group,
              err: torch.Tensor | None = None, beta: float = 0.0) -> torch.Tensor:
    """Quantise ``values`` ([parts, m]), send part ``i`` to member ``i``; the received parts, dequantised."""
    q, s = _compensated(values, block, err, beta)
    q_in, s_in = torch.empty_like(q), torch.empty_like(s)
    _all_to_all(level, q_in, q, group)
    _all_to_all(level, s_in, s, group)
    return dequantize_int4(q_in, s_in).view(parts, -1)


@torch.no_grad()
def quantized_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, h: Hierarchy, block: int,
                             errors: tuple[torch.Tensor, torch.Tensor] | None = None, err_beta: float = 0.8) -> None:
    """``out`` (``c`` elements, ``block`` dividing ``c``) gets the sum over all ranks of this rank's chunk of
    ``inp`` (``world * c`` elements, rank-major), moved as int4. ``errors``: LoCo's fp32 error buffers
    (``world * c`` elements for the intra-node level, ``nodes * c`` for the inter-node one), updated."""
    nodes, k = h.layout.nodes, h.layout.ranks_per_node
    c = out.numel()
    if inp.numel() != nodes * k * c:
        raise ValueError(f"quantized_reduce_scatter: input of {inp.numel()} elements is not {nodes * k} chunks of {c}")
    swizzled = inp.reshape(nodes, k, c).transpose(0, 1)  # [local][node][c]
    intra, inter = errors if errors is not None else (None, None)
    node_sum = _exchange("intra", swizzled, block, k, h.intra, intra, err_beta).sum(dim=0)  # [node * c]: my local
    total = _exchange("inter", node_sum, block, nodes, h.inter, inter, err_beta).sum(dim=0)  # index; my chunk
    out.reshape(-1).copy_(total)
