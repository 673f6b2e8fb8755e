"""Tiled LM head + loss: the ``[tokens, vocab]`` logits of only one shard of tokens exist at a time.

The logits are the largest activation of a language model at long sequence (vocab ≫ hidden). The loss is
the end of the forward, so instead of recomputing in backward (as :mod:`.tiled` does), each shard's
gradient is taken right away in the forward, as DeepSpeed's ``TiledFusedLogitsLoss`` does: per shard,
``logits = head(x_shard)``, ``loss_shard = fn(...)``, backward of that shard (freeing its logits), keep the
gradients of ``x`` and of the head's weights. ``backward`` then only scales them by the incoming gradient,
and the weights' gradients reach autograd once, as input gradients (a head tied to the embedding is
accumulated once with the embedding's own gradient).

``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)`` keeps
DeepSpeed's semantics: the result is the mean (or sum) of the per-shard values ``fn`` returns, so with
"mean" and a shorter last shard (or masked tokens) it is not the token mean. :func:`fused_logits_loss`
gives the exact token mean of cross entropy (``-100`` ignored, labels shifted as Hugging Face does, or
``shift_labels`` already shifted) by summing per shard and dividing by the count of counted tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from .tiled import ShardGrads, gathered, shard_bounds, trainable_params

__all__ = ["TiledFusedLogitsLoss", "fused_logits_loss"]

IGNORE_INDEX = -100


class _TiledLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], module: Any, y: torch.Tensor, mask: torch.Tensor | None,
                shards: int, reduction: str, train: bool, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        rows_x = x.detach().reshape(-1, *x.shape[2:])
        rows_y = y.reshape(-1, *y.shape[2:])
        rows_mask = mask.reshape(-1) if mask is not None else None
        bounds = shard_bounds(rows_x.shape[0], shards)
        need_x = train and x.requires_grad
        x_grad = torch.zeros_like(rows_x) if need_x else None
        sink = ShardGrads([p for p in params if p.requires_grad] if train else [])
        scale = 1.0 / len(bounds) if reduction == "mean" else 1.0
        outs = []
        for a, b in bounds:
            args = (module, rows_x[a:b].detach().requires_grad_(need_x), rows_y[a:b])
            if rows_mask is not None:
                args += (rows_mask[a:b],)
            with torch.enable_grad() if train else torch.no_grad():
                out = fn(*args)
            if train:
                g = sink.backward(out, torch.full_like(out, scale), args[1])
                if x_grad is not None:
                    x_grad[a:b] = g if g is not None else 0.0
            outs.append(out.detach())
        ctx.x_grad = x_grad.view_as(x) if x_grad is not None else None
        ctx.sink = sink
        ctx.param_mask = [train and p.requires_grad for p in params]
        total = torch.stack(outs)
        return total.mean() if reduction == "mean" else total.sum()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scale = None if bool(grad_out == 1.0) else grad_out
        x_grad = ctx.x_grad if scale is None or ctx.x_grad is None else ctx.x_grad * scale
        ctx.sink.deliver_others(scale)
        summed = iter(ctx.sink.param_grads(scale))
        param_grads = tuple(next(summed) if used else None for used in ctx.param_mask)
        ctx.x_grad = ctx.sink = None  # one backward: free the held gradients
        return (None,) * 7 + (x_grad,) + param_grads


class TiledFusedLogitsLoss:
    """DeepSpeed's tiled logits + loss: ``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards,
    compute_params, output_reduction)`` with ``fn(self, x_shard, y_shard[, mask_shard]) -> scalar``.

    ``x`` is ``[batch, seq, hidden]``, ``y`` ``[batch, seq, ...]``, ``mask`` None or ``[batch, seq]``; batch
    and sequence are flattened and cut into ``shards`` (a shorter last shard if uneven). The result is the
    "mean" or "sum" of the shard values. The parameters of ``self`` and ``compute_params`` get gradients.
    """

    @staticmethod
    def apply(fn: Callable[..., torch.Tensor], self: Any, x: torch.Tensor, y: torch.Tensor,
              mask: torch.Tensor | None, shards: int, compute_params: Iterable[torch.Tensor] | None,
              output_reduction: str) -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f'unknown reduction {output_reduction!r}: valid values are "mean", "sum"')
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError(f"x and y must be at least 2D [batch_size, seq_len, ...]; got {tuple(x.shape)} and "
                             f"{tuple(y.shape)}")
        if x.shape[:2] != y.shape[:2]:
            raise ValueError(f"x and y batch/seq dims must match: {tuple(x.shape[:2])} vs {tuple(y.shape[:2])}")
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"mask must be [batch_size, seq_len] = {tuple(x.shape[:2])}, got {tuple(mask.shape)}")
        params = trainable_params(self, compute_params)
        train = torch.is_grad_enabled() and (x.requires_grad or bool(params))
        y = y.detach()
        mask = mask.detach() if mask is not None else None
        with gathered(params):  # ZeRO stage 3: whole while autograd records them
            return _TiledLossFunction.apply(fn, self, y, mask, int(shards), output_reduction, train, x, *params)


def _summed_cross_entropy(head: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor
                          ) -> torch.Tensor:
    logits = head(x)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")


def fused_logits_loss(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], *,
                      labels: torch.Tensor | None = None, shift_labels: torch.Tensor | None = None,
                      shards: int, reduction: str = "mean",
                      compute_params: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
    """Cross entropy of ``head(hidden)`` against the next token, tiled over ``shards``; never all the logits.

    Give ``labels`` (``[batch, seq]``, as for a Hugging Face causal LM: shifted here, the last position
    ignored) or ``shift_labels`` (already shifted, e.g. by the Ulysses data-loader adapter). Tokens labelled
    ``-100`` do not count. ``reduction="mean"`` is the mean over counted tokens (what
    ``F.cross_entropy`` gives untiled, for any shard count); ``"sum"`` their sum. Half-precision logits
    are upcast to fp32 for the loss. ``head`` is a module (its parameters get gradients) or a function of
    ``compute_params``.
    """
    if (labels is None) == (shift_labels is None):
        raise ValueError("give exactly one of labels (unshifted) or shift_labels (already shifted)")
    if reduction not in ("mean", "sum"):
        raise ValueError(f'unknown reduction {reduction!r}: valid values are "mean", "sum"')
    if shift_labels is None:
        assert labels is not None
        shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    total = TiledFusedLogitsLoss.apply(_summed_cross_entropy, head, hidden, shift_labels, None, shards,
                                       compute_params, "sum")
    if reduction == "sum":
        return total
    return total / (shift_labels != IGNORE_INDEX).sum()
