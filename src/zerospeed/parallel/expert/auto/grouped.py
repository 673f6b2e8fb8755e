"""One grouped matmul for all of a rank's experts: rows sorted by expert, each block times its expert's weight.

``x`` ``[N, K]`` holds the rows of expert 0, then expert 1, ... (``counts[e]`` rows each); ``w`` is ``[E, K, M]``;
the result ``[N, M]`` has ``x[rows of e] @ w[e]`` in the rows of ``e``. ``torch._grouped_mm`` does it in one
kernel where it runs (CUDA; on CPU when every row stride is a multiple of 16 bytes); elsewhere a loop of
per-expert matmuls gives the same numbers. The grouped kernel's backward needs a dense output gradient,
so the output's gradient is made contiguous on its way in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _aligned(*tensors: Tensor) -> bool:
    return all(s * t.element_size() % 16 == 0 for t in tensors for s in t.stride() if s != 1)


def grouped_available(x: Tensor, w: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can take these operands (it exists and the strides are aligned)."""
    return hasattr(torch, "_grouped_mm") and x.dtype == w.dtype and _aligned(x, w)


def grouped_mm(x: Tensor, w: Tensor, counts: list[int], use_grouped: bool = True) -> Tensor:
    """``[N, K] x [E, K, M] -> [N, M]``, block ``e`` of ``x`` (``counts[e]`` rows) times ``w[e]``."""
    if use_grouped and grouped_available(x, w):
        offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(x.device)
        out = torch._grouped_mm(x, w, offs=offs)
        if out.requires_grad:
            out.register_hook(lambda g: g.contiguous())
        return out
    parts = [xe @ w[e] for e, xe in enumerate(x.split(counts))]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


def expert_mlp(x: Tensor, counts: list[int], w1: Tensor, w2: Tensor, w3: Tensor | None,
               act: Callable[[Tensor], Tensor], use_grouped: bool = True) -> Tensor:
    """The gated MLP of every expert on its rows: ``(act(x W1g^T) * x W1u^T) W2^T`` (HF's fused layout:
    ``w1`` ``[E, 2I, H]`` = gate then up, or ``[E, I, H]`` with ``w3`` the up projection; ``w2`` ``[E, H, I]``)."""
    if w3 is None:
        gate, up = grouped_mm(x, w1.transpose(1, 2), counts, use_grouped).chunk(2, dim=-1)
    else:
        gate = grouped_mm(x, w1.transpose(1, 2), counts, use_grouped)
        up = grouped_mm(x, w3.transpose(1, 2), counts, use_grouped)
    return grouped_mm(act(gate) * up, w2.transpose(1, 2), counts, use_grouped)
