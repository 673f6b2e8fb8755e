"""Cross-entropy over vocab-parallel logits: full logits never exist on one rank.

Each rank holds logits ``[..., V_r]`` for its vocabulary rows ``[start, start + V_r)``. For every token::

    m     = all-reduce MAX of the local maxima                 (numerical stability)
    sum_e = all-reduce SUM of sum(exp(logit - m)) over V_r
    t     = all-reduce SUM of the target's logit (only its owner contributes)   [one all-reduce with sum_e]
    loss  = log(sum_e) + m - t                                 (0 for ignore_index)

Backward is local: ``softmax - onehot(target)`` on this rank's columns, times the loss gradient. What is
kept for backward is this rank's ``exp`` (``[..., V_r]``), never ``[..., V]``. The signature is DeepSpeed
0.19.8's ``deepspeed.sequence.cross_entropy.vocab_parallel_cross_entropy``; ``sp_group`` sums the loss
over sequence shards held by other ranks.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ... import comm
from .mappings import gather_from_sequence_parallel_region, tp_rank, tp_world_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any, start: int,
                ignore_index: int) -> torch.Tensor:
        x = logits.float()
        width = x.shape[-1]
        m = x.amax(dim=-1)
        if tp_world_size(group) > 1:
            comm.all_reduce(m, group, op=comm.ReduceOp.MAX)
        e = torch.exp(x - m.unsqueeze(-1))
        valid = target != ignore_index
        mine = valid & (target >= start) & (target < start + width)
        local_t = (target - start).clamp(0, max(width - 1, 0))
        t = torch.where(mine, x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1), torch.zeros_like(m))
        both = torch.stack([e.sum(dim=-1), t])
        if tp_world_size(group) > 1:
            comm.all_reduce(both, group)
        sum_e, t = both[0], both[1]
        loss = torch.where(valid, torch.log(sum_e) + m - t, torch.zeros_like(m))
        e.div_(sum_e.unsqueeze(-1))  # softmax on this rank's columns, in place
        ctx.save_for_backward(e, local_t, mine, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        softmax, local_t, mine, valid = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local_t.unsqueeze(-1), -mine.unsqueeze(-1).to(g.dtype))
        g.mul_((grad.to(g.dtype) * valid.to(g.dtype)).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None, None


def _vocab_bounds(width: int, start: int | None, end: int | None, group: Any) -> tuple[int, int, int]:
    """``(start, end, global vocab)``: given, or from every rank's width (one small all-gather)."""
    if (start is None) != (end is None):
        raise ValueError("vocab_start_index and vocab_end_index must be given together")
    if start is not None and end is not None and end - start != width:
        raise ValueError(f"vocab_end_index - vocab_start_index = {end - start} but the logits hold {width} columns")
    widths = [w[0] for w in comm.exchange_ints([width], group)] if tp_world_size(group) > 1 else [width]
    if min(widths) <= 0:
        raise ValueError(f"vocab-parallel cross-entropy: a rank holds no vocabulary columns (widths {widths})")
    mine = sum(widths[: tp_rank(group)])
    if start is not None and start != mine:
        raise ValueError(f"vocab_start_index {start} does not follow the ranks' widths {widths} (expected {mine})")
    return mine, mine + width, sum(widths)


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, tp_group: Any = None,
                                 sp_group: Any = None, vocab_start_index: int | None = None,
                                 vocab_end_index: int | None = None, global_vocab_size: int | None = None,
                                 ignore_index: int = -100, reduction: str = "mean", gather_sequence_loss: bool = False,
                                 backend: str = "torch") -> torch.Tensor:
    """Cross-entropy of ``vocab_parallel_logits`` ``[..., V_r]`` against ``target`` ``[...]`` (same on all TP ranks).

    ``reduction``: ``"mean"`` (over tokens not equal to ``ignore_index``; 0 when there are none, as
    DeepSpeed), ``"sum"`` or ``"none"`` (per-token losses). ``global_vocab_size`` with explicit bounds
    skips the width exchange.
    """
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(vocab_parallel_logits.shape)} and target {tuple(target.shape)} must match "
                         "on every dimension but the last")
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    if backend not in ("torch", "liger"):
        raise ValueError(f"backend must be 'torch' or 'liger', got {backend!r}")
    if backend == "liger":
        warnings.warn("vocab_parallel_cross_entropy: the liger backend is not supported yet by zerospeed; "
                      "using the PyTorch one", stacklevel=2)
    if gather_sequence_loss and reduction != "none":
        raise ValueError("gather_sequence_loss needs reduction='none'")
    width = vocab_parallel_logits.shape[-1]
    if global_vocab_size is None or vocab_start_index is None:
        vocab_start_index, vocab_end_index, global_vocab_size = _vocab_bounds(
            width, vocab_start_index, vocab_end_index, tp_group)
    target = target.long()
    bad = (target != ignore_index) & ((target < 0) | (target >= global_vocab_size))
    if bool(bad.any()):
        raise ValueError(f"a target is outside the vocabulary of {global_vocab_size} (and is not ignore_index "
                         f"{ignore_index})")
    loss = _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group, vocab_start_index, ignore_index)
    if reduction == "none":
        if gather_sequence_loss:
            if sp_group is None:
                raise ValueError("gather_sequence_loss needs sp_group")
            loss = gather_from_sequence_parallel_region(loss, sp_group, seq_dim=0)
        return loss
    total = _sum_over(loss.sum(), sp_group)
    if reduction == "sum":
        return total
    count = (target != ignore_index).sum().to(loss.dtype)
    if sp_group is not None and comm.get_world_size(sp_group) > 1:
        comm.all_reduce(count, sp_group)
    return total / count.clamp_min(1)


def _sum_over(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``local`` over ``group``; its gradient flows to this rank's own term only."""
    if group is None or comm.get_world_size(group) == 1:
        return local
    total = local.detach().clone()
    comm.all_reduce(total, group)
    return local + (total - local.detach())
