"""Vocab-parallel embedding, lm head and cross-entropy on real Gloo ranks (tp 2 and 4, uneven vocabularies):
losses and gradients equal the unsplit ones; the cross-entropy keeps only this rank's columns for backward."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed import comm
from zerospeed.module_inject.layers import VocabParallelEmbedding, VocabParallelLinear
from zerospeed.parallel.tensor import vocab_parallel_cross_entropy
from zerospeed.testing import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)
V, D, B, S = 11, 4, 2, 4   # 11 rows: [6, 5] at tp 2, [3, 3, 3, 2] at tp 4


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def _embedding(group, rank: int, tp: int, sp: bool) -> None:
    torch.manual_seed(0)
    full = nn.Embedding(V, D, padding_idx=3)
    emb = VocabParallelEmbedding(copy.deepcopy(full), group, sequence_parallel=sp, name="wte")
    me = slice(emb.vocab_start_index, emb.vocab_end_index)
    assert torch.equal(emb.weight, full.weight[me])
    ids = _tokens(1)
    ids[0, 0] = 3   # the padding row gets no gradient
    probe = torch.randn(B, S, D, generator=torch.Generator().manual_seed(2))
    y_full = full(ids)
    (y_full * probe).sum().backward()
    seq = slice(rank * S // tp, (rank + 1) * S // tp) if sp else slice(None)
    y = emb(ids)
    torch.testing.assert_close(y, y_full[:, seq], **TOL)
    (y * probe[:, seq]).sum().backward()
    torch.testing.assert_close(emb.weight.grad, full.weight.grad[me], **TOL)


def _cross_entropy(group, rank: int, tp: int) -> None:
    logits_full = torch.randn(B, S, V, generator=torch.Generator().manual_seed(3)).requires_grad_()
    target = _tokens(4)
    target[1, 2] = -100
    sizes = [V // tp + (1 if r < V % tp else 0) for r in range(tp)]
    start = sum(sizes[:rank])
    me = slice(start, start + sizes[rank])
    for reduction in ("mean", "sum", "none"):
        logits_full.grad = None
        ref = F.cross_entropy(logits_full.view(-1, V), target.view(-1), ignore_index=-100,
                              reduction=reduction)
        ref = ref.view(B, S) if reduction == "none" else ref
        (ref * (torch.arange(B * S).view(B, S) + 1.0) if reduction == "none" else ref).sum().backward()
        local = logits_full.detach()[..., me].clone().requires_grad_()
        saved: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = vocab_parallel_cross_entropy(local, target, group, reduction=reduction)
        torch.testing.assert_close(loss, ref.detach(), **TOL)
        assert max(saved) == B * S * sizes[rank], saved   # never [.., V]: this rank's columns only
        (loss * (torch.arange(B * S).view(B, S) + 1.0) if reduction == "none" else loss).sum().backward()
        torch.testing.assert_close(local.grad, logits_full.grad[..., me], **TOL)
    bounds = vocab_parallel_cross_entropy(logits_full.detach()[..., me], target, group, vocab_start_index=start,
                                          vocab_end_index=start + sizes[rank], global_vocab_size=V)
    torch.testing.assert_close(bounds, F.cross_entropy(logits_full.detach().view(-1, V), target.view(-1)), **TOL)


def _tied_lm(group, rank: int, tp: int) -> None:
    """Embedding and lm head share one weight; the whole chain equals the unsplit model."""
    torch.manual_seed(0)
    emb_full, head_full = nn.Embedding(V, D), nn.Linear(D, V, bias=False)
    head_full.weight = emb_full.weight
    emb_tp, head_tp = copy.deepcopy(emb_full), copy.deepcopy(head_full)
    head_tp.weight = emb_tp.weight
    head = VocabParallelLinear(head_tp, group, name="lm_head")
    emb = VocabParallelEmbedding(emb_tp, group, tied_vocab_parallel_linear=head, name="wte")
    assert emb.weight is head.weight and emb.weight.shape[0] == head.partition_sizes[rank]
    ids, target = _tokens(5), _tokens(6)
    ref = F.cross_entropy(head_full(torch.tanh(emb_full(ids))).view(-1, V), target.view(-1))
    ref.backward()
    loss = vocab_parallel_cross_entropy(head(torch.tanh(emb(ids))), target, group)
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    loss.backward()
    me = slice(head.vocab_start_index, head.vocab_end_index)
    torch.testing.assert_close(head.weight.grad, emb_full.weight.grad[me], **TOL)


def _all() -> int:
    group, rank, tp = comm.world_group(), comm.get_rank(), comm.get_world_size()
    _embedding(group, rank, tp, False)
    _embedding(group, rank, tp, True)
    _cross_entropy(group, rank, tp)
    _tied_lm(group, rank, tp)
    return tp


def test_vocab_parallel_tp2() -> None:
    assert run_distributed(_all, 2, timeout=90) == [2, 2]


def test_vocab_parallel_tp4() -> None:
    assert run_distributed(_all, 4, timeout=120) == [4] * 4
