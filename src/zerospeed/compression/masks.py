"""Pruning masks: keep the ``ceil(ratio * n)`` largest scores, zero the rest (DeepSpeed 0.19.6's ``TopKBinarizer``).

``l1`` pruning scores each unit by its weights' magnitude once, when the technique is switched on, and keeps
that mask. ``topk`` pruning learns the scores: a parameter initialised like a linear weight (Kaiming uniform,
``a = sqrt(5)``), binarised at every forward, whose gradient is the mask's gradient passed straight through.
The unit is a weight (sparse), an output row (row), a head's slice of the input columns (head: applied to the
attention output projection) or an output channel (channel, convolutions).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class _TopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, ratio: float) -> torch.Tensor:  # type: ignore[override]
        return topk_mask(scores, ratio)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad.clone(), None


def topk_mask(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """1 at the ``ceil(ratio * n)`` largest entries of ``scores`` (ties: the sort's order), 0 elsewhere."""
    keep = math.ceil(ratio * scores.numel())
    order = scores.detach().flatten().sort(descending=True).indices
    flat = torch.zeros(scores.numel(), dtype=scores.dtype, device=scores.device)
    flat[order[:keep]] = 1.0
    return flat.reshape(scores.shape)


def learned_mask(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """``topk_mask`` whose gradient flows to ``scores`` unchanged (straight through)."""
    return _TopK.apply(scores, ratio)  # type: ignore[no-any-return]


def new_scores(shape: tuple[int, ...], device: torch.device) -> nn.Parameter:
    """Learned pruning scores, initialised as DeepSpeed does (Kaiming uniform with ``a = sqrt(5)``)."""
    scores = nn.Parameter(torch.empty(shape, device=device))
    nn.init.kaiming_uniform_(scores, a=math.sqrt(5))
    return scores


def l1_scores(weight: torch.Tensor, unit: str) -> torch.Tensor:
    """The magnitude scores of ``l1`` pruning: per weight, per output row or per output channel."""
    w = weight.detach()
    if unit == "sparse":
        return w.abs()
    if unit == "row":
        return torch.linalg.norm(w, ord=1, dim=1)
    if unit == "channel":
        return torch.linalg.norm(w.flatten(1), ord=1, dim=1)
    raise ValueError(f"no l1 scores for unit {unit!r}")


def head_mask_columns(weight: torch.Tensor, mask: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``weight [out, in]`` with the input columns of pruned heads (``mask [1, num_heads]``) zeroed."""
    out, inp = weight.shape
    return (weight.t().reshape(num_heads, -1) * mask.reshape(-1, 1)).reshape(inp, out).t()
