"""Tiled compute (TiledMLP, sequence_tiled_compute, TiledFusedLogitsLoss): same loss and gradients as untiled.

Sequences here do not divide evenly into the shards (37 tokens into 4 shards: 10, 10, 10, 7). Parity is
checked in float64 at rtol 1e-6 (in fp32 a weight gradient summed shard by shard differs from one matmul's
in the last bits: ~1e-5 relative on near-zero entries); the GPT check runs in fp32 at a float tolerance.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.models import GPT, GPTConfig
from zerospeed.parallel.sequence.tiled import TiledMLP, sequence_tiled_compute, shard_bounds
from zerospeed.parallel.sequence.tiled_loss import TiledFusedLogitsLoss, fused_logits_loss

RTOL, ATOL = 1e-6, 1e-12


@pytest.fixture(autouse=True)
def _float64() -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> None:
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


class _MLP(nn.Module):
    def __init__(self, d: int = 16, p: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.proj, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(p)

    def core(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.drop(F.gelu(self.fc(x))))


def _mlp_fn(mlp: _MLP, x: torch.Tensor) -> torch.Tensor:
    return mlp.core(x)


def _grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad] + [p.grad for p in module.parameters()]  # type: ignore[list-item]


def _run(module: nn.Module, x0: torch.Tensor, forward, seed: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = forward(x)
    loss = out if out.dim() == 0 else (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
    loss.backward()
    return loss.detach(), _grads(module, x)


def test_shard_bounds_is_deepspeeds_cut() -> None:
    assert shard_bounds(37, 4) == [(0, 10), (10, 20), (20, 30), (30, 37)]
    assert shard_bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert shard_bounds(6, 4) == [(0, 2), (2, 4), (4, 6)]  # like torch.chunk: fewer, never empty
    assert shard_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert shard_bounds(0, 2) == [(0, 0)]
    with pytest.raises(ValueError, match="shards must be >= 1"):
        shard_bounds(4, 0)


@pytest.mark.parametrize("shape", [(2, 37, 16), (37, 16)])
def test_tiled_mlp_matches_untiled(shape: tuple[int, ...]) -> None:
    mlp = _MLP()
    x0 = torch.randn(*shape)
    loss_ref, ref = _run(mlp, x0, mlp.core)
    loss, got = _run(mlp, x0, lambda x: TiledMLP.apply(_mlp_fn, mlp, x, 4, None))
    _close(loss, loss_ref)
    for g, r in zip(got, ref):
        _close(g, r)


def test_tiled_mlp_replays_dropout_masks() -> None:
    mlp = _MLP(p=0.5)
    x0 = torch.randn(2, 37, 16)
    loss_ref, ref = _run(mlp, x0, lambda x: torch.cat([mlp.core(x[:, a:b]) for a, b in shard_bounds(37, 4)], 1))
    loss, got = _run(mlp, x0, lambda x: TiledMLP.apply(_mlp_fn, mlp, x, 4, [mlp.fc.weight]))
    _close(loss, loss_ref)
    for g, r in zip(got, ref):
        _close(g, r)


def test_parameter_gradients_arrive_once_per_backward() -> None:
    """ZeRO reducers count one gradient arrival per parameter: shard-by-shard accumulation would fire 4 hooks."""
    mlp = _MLP()
    calls: dict[str, int] = {}
    for name, p in mlp.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=name: calls.__setitem__(n, calls.get(n, 0) + 1))
    x = torch.randn(2, 37, 16, requires_grad=True)
    TiledMLP.apply(_mlp_fn, mlp, x, 4, None).sum().backward()
    assert calls == {name: 1 for name, _ in mlp.named_parameters()}


def test_leaves_outside_self_get_their_gradient() -> None:
    mlp = _MLP()
    scale = torch.randn(16, requires_grad=True)

    def fn(m: _MLP, x: torch.Tensor) -> torch.Tensor:
        return m.core(x) * scale

    x0 = torch.randn(2, 37, 16)
    _run(mlp, x0, lambda x: mlp.core(x) * scale)
    ref = scale.grad.clone()
    scale.grad = None
    _run(mlp, x0, lambda x: TiledMLP.apply(fn, mlp, x, 4, None))
    _close(scale.grad, ref)


def test_sequence_tiled_compute_unsharded_output() -> None:
    mlp = _MLP()
    bias = torch.randn(2, 37, 1)  # sharded but gets no gradient

    def fn(hidden: torch.Tensor, offset: torch.Tensor, factor: float) -> torch.Tensor:
        return mlp.core(hidden + offset) * factor

    x0 = torch.randn(2, 37, 16)
    loss_ref, ref = _run(mlp, x0, lambda x: fn(x, bias, 0.5))
    compute = list(mlp.parameters())
    loss, got = _run(mlp, x0, lambda x: sequence_tiled_compute(
        fn, 37, 4, {"hidden": x, "offset": bias}, {"factor": 0.5}, "hidden", compute, 1, None))
    _close(loss, loss_ref)
    for g, r in zip(got, ref):
        _close(g, r)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_sequence_tiled_compute_scalar_shards(reduction: str) -> None:
    """output_unshard_dimension=0: each shard returns a scalar; the result is their mean or sum (DeepSpeed)."""
    mlp = _MLP()

    def fn(hidden: torch.Tensor) -> torch.Tensor:
        return mlp.core(hidden).pow(2).mean()

    def reference(x: torch.Tensor) -> torch.Tensor:
        parts = torch.stack([fn(x[:, a:b]) for a, b in shard_bounds(37, 4)])
        return parts.mean() if reduction == "mean" else parts.sum()

    x0 = torch.randn(2, 37, 16)
    loss_ref, ref = _run(mlp, x0, reference)
    loss, got = _run(mlp, x0, lambda x: sequence_tiled_compute(fn, 37, 4, {"hidden": x}, {}, "hidden",
                                                               list(mlp.parameters()), 0, reduction))
    _close(loss, loss_ref)
    for g, r in zip(got, ref):
        _close(g, r)


def test_sequence_tiled_compute_rejects_bad_arguments() -> None:
    x = torch.randn(2, 37, 4)
    with pytest.raises(ValueError, match="output_reduction"):
        sequence_tiled_compute(lambda hidden: hidden, 37, 2, {"hidden": x}, {}, "hidden", None, 1, "max")
    with pytest.raises(ValueError, match="seqlen=36"):
        sequence_tiled_compute(lambda hidden: hidden, 36, 2, {"hidden": x}, {}, "hidden", None, 1, None)
    with pytest.raises(ValueError, match="grad_requiring_tensor_key"):
        sequence_tiled_compute(lambda hidden: hidden, 37, 2, {"hidden": x}, {}, "h", None, 1, None)


# --- logits + loss ------------------------------------------------------------------------------------------
def _labels(b: int, t: int, vocab: int) -> torch.Tensor:
    y = torch.randint(vocab, (b, t), generator=torch.Generator().manual_seed(3))
    y[0, 5:9] = -100
    y[1, -1] = -100
    return y


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_logits_loss_matches_cross_entropy(reduction: str) -> None:
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=False)
    labels = _labels(2, 37, 50)
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)

    def untiled(x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(x).view(-1, 50), shifted.view(-1), reduction=reduction)

    x0 = torch.randn(2, 37, 16)
    loss_ref, ref = _run(head, x0, untiled)
    for kwargs in ({"labels": labels}, {"shift_labels": shifted}):
        loss, got = _run(head, x0, lambda x: fused_logits_loss(x, head, shards=4, reduction=reduction, **kwargs))
        _close(loss, loss_ref)
        for g, r in zip(got, ref):
            _close(g, r)


def test_tiled_fused_logits_loss_deepspeed_semantics() -> None:
    """DeepSpeed's "mean" is the mean of the shard values (with a mask passed to fn), and scales with grad_out."""
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=False)
    y = _labels(2, 37, 50).clamp(min=0)
    mask = (torch.arange(37) % 3 != 0).expand(2, 37)

    def fn(h: nn.Linear, x: torch.Tensor, t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        per_token = F.cross_entropy(h(x), t, reduction="none")
        return (per_token * m).sum() / m.sum()

    def reference(x: torch.Tensor) -> torch.Tensor:
        rows, ys, ms = x.reshape(-1, 16), y.reshape(-1), mask.reshape(-1)
        parts = [fn(head, rows[a:b], ys[a:b], ms[a:b]) for a, b in shard_bounds(74, 4)]
        return 3.0 * torch.stack(parts).mean()

    x0 = torch.randn(2, 37, 16)
    loss_ref, ref = _run(head, x0, reference)
    loss, got = _run(head, x0, lambda x: 3.0 * TiledFusedLogitsLoss.apply(fn, head, x, y, mask, 4, None, "mean"))
    _close(loss, loss_ref)
    for g, r in zip(got, ref):
        _close(g, r)
    with pytest.raises(ValueError, match="unknown reduction"):
        TiledFusedLogitsLoss.apply(fn, head, x0, y, mask, 4, None, "max")
    with pytest.raises(ValueError, match="mask must be"):
        TiledFusedLogitsLoss.apply(fn, head, x0, y, mask[:, :5], 4, None, "mean")


def test_tiled_loss_without_grad_computes_only_the_loss() -> None:
    head = nn.Linear(16, 50, bias=False)
    labels = _labels(2, 37, 50)
    x = torch.randn(2, 37, 16)
    with torch.no_grad():
        loss = fused_logits_loss(x, head, labels=labels, shards=3)
        ref = F.cross_entropy(head(x)[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1))
    assert not loss.requires_grad and head.weight.grad is None
    _close(loss, ref)


# --- the GPT's options --------------------------------------------------------------------------------------
def test_gpt_tiled_options_match_untiled_with_a_tied_head() -> None:
    torch.set_default_dtype(torch.float32)
    base = dict(vocab_size=64, block_size=37, n_layer=2, n_head=2, n_embd=16)
    idx = torch.randint(64, (2, 37), generator=torch.Generator().manual_seed(1))
    targets = _labels(2, 37, 64)
    results = []
    for shards in ({}, {"tiled_mlp_shards": 4, "tiled_loss_shards": 3}):
        model = GPT(GPTConfig(**base, **shards), seed=0)
        counts = {"wte": 0}
        model.wte.weight.register_post_accumulate_grad_hook(lambda _: counts.__setitem__("wte", counts["wte"] + 1))
        logits, loss = model(idx, targets)
        loss.backward()
        assert counts["wte"] == 1  # the tied head's gradient is accumulated with the embedding's, once
        results.append((logits, loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (logits_ref, loss_ref, ref), (logits, loss, got) = results
    assert logits_ref is not None and logits is None  # the tiled loss never makes the full logits
    _close(loss, loss_ref, 1e-5, 1e-6)
    for name in ref:
        _close(got[name], ref[name], 1e-5, 1e-6)
    with pytest.raises(ValueError, match="tiled_mlp_shards"):
        GPTConfig(tiled_mlp_shards=0)
