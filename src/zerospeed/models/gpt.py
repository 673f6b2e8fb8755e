"""A small byte-level GPT: the model our demo, tests and benchmarks train.

The shape is the classic decoder-only transformer: token and position embeddings, ``n_layer`` pre-LayerNorm
blocks (causal self-attention through ``F.scaled_dot_product_attention``, then a GELU MLP), a final LayerNorm
and an LM head that shares its weight with the token embedding. Initialisation draws from a private
``torch.Generator`` seeded by ``seed``, so two processes building ``GPT(config, seed=s)`` hold identical weights
without touching the global RNG (construction runs under ``fork_rng``) — the basis of every parity test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.parallel.sequence.tiled import TiledMLP
from zerospeed.parallel.sequence.tiled_loss import fused_logits_loss

__all__ = ["GPT", "GPTConfig", "bench", "demo", "gpt2_small", "mid", "tiny"]


@dataclass(frozen=True)
class GPTConfig:
    """Model hyper-parameters. ``vocab_size=256`` means one token per byte."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tiled_mlp_shards: int = 1  # > 1: MLPs run as TiledMLP over this many sequence shards (long context)
    tiled_loss_shards: int = 1  # > 1: LM head + loss tiled (no [seq, vocab] logits; forward returns None logits)

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "tiled_mlp_shards",
                     "tiled_loss_shards"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


def tiny() -> GPTConfig:
    """About 35k parameters: for unit and multi-process tests."""
    return GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


def demo() -> GPTConfig:
    """About 1.9M parameters: learns visibly in a few minutes on two CPU processes."""
    return GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=192)


def bench() -> GPTConfig:
    """About 10.8M parameters: a heavier benchmark where communication and optimizer state matter more."""
    return GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384)


def mid() -> GPTConfig:
    """About 27M parameters (6 layers, width 608): the smaller size of the peer benchmark."""
    return GPTConfig(block_size=256, n_layer=6, n_head=8, n_embd=608)


def gpt2_small() -> GPTConfig:
    """GPT-2 small's shape (124M parameters: 12 layers, width 768, 12 heads, vocabulary 50257, seq 512)."""
    return GPTConfig(vocab_size=50257, block_size=512, n_layer=12, n_head=12, n_embd=768)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal SDPA in the ``[batch, seq, heads, head_dim]`` layout (in and out)."""
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p,
                                       is_causal=True)
    return y.transpose(1, 2)


class CausalSelfAttention(nn.Module):
    """Multi-head attention where position t sees only positions <= t.

    ``core_attention`` (None: ``causal_attention``) replaces the core ``(q, k, v, dropout_p) -> y`` over
    ``[b, t, h, d]``: the hook sequence parallelism uses (``parallel/sequence/gpt.py``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.core_attention: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # shapes read from the qkv output: a tensor-parallel shard (heads, sequence) works too
        b, t, _ = qkv.shape
        q, k, v = (z.reshape(b, t, -1, self.head_dim) for z in qkv.chunk(3, dim=2))
        p = self.dropout if self.training else 0.0
        core = causal_attention if self.core_attention is None else self.core_attention
        y = core(q, k, v, dropout_p=p)
        return self.resid_drop(self.proj(y.contiguous().view(b, t, -1)))


class MLP(nn.Module):
    """Position-wise feed-forward: widen 4x, GELU, project back."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)
        self.shards = cfg.tiled_mlp_shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shards > 1:
            return self.drop(TiledMLP.apply(_mlp_core, self, x, self.shards, None))
        return self.drop(_mlp_core(self, x))


def _mlp_core(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    return mlp.proj(F.gelu(mlp.fc(x)))


class Block(nn.Module):
    """Pre-LN residual block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, keep_prob: float = 1.0) -> torch.Tensor:
        """``keep_prob`` < 1 (progressive layer drop): the block ran with this probability, so its residual
        branches are scaled by ``1 / keep_prob`` to keep their expected contribution."""
        h = self.attn(self.ln1(x))
        x = x + (h if keep_prob == 1.0 else h / keep_prob)
        h = self.mlp(self.ln2(x))
        return x + (h if keep_prob == 1.0 else h / keep_prob)


class GPT(nn.Module):
    """Decoder-only transformer over bytes; ``forward(idx, targets)`` returns ``(logits, loss or None)``
    (``(None, loss)`` with ``tiled_loss_shards > 1``: the full logits are never made)."""

    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        with torch.random.fork_rng(devices=[]):  # PyTorch's default init draws are discarded below
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one tensor, counted once by parameters()
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """N(0, 0.02) weights, zero biases, unit LayerNorms; residual projections scaled by 1/sqrt(2*n_layer)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():  # fixed order, so the stream of draws is reproducible
            if p.dim() < 2:
                p.fill_(1.0 if "ln" in name and name.endswith("weight") else 0.0)
                continue
            std = resid_std if name.endswith("proj.weight") else 0.02
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))

    def _drop_layers(self, x: torch.Tensor, theta: float) -> torch.Tensor:
        """Stochastic depth: block ``i`` runs with probability ``p_i = 1 - i * (1 - theta) / n_layer``."""
        step = (1.0 - theta) / len(self.blocks)
        for i, block in enumerate(self.blocks):
            keep = 1.0 - i * step
            if keep >= 1.0 or float(torch.rand(())) < keep:
                x = block(x, keep_prob=keep)
        return x

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (the tied head counted once); ``non_embedding`` drops the position table."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
        curriculum_seqlen: int | None = None, progressive_layer_drop: bool = False, pld_theta: float = 1.0,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``position_ids`` (default ``0..t-1``): positions of ``idx``'s tokens, e.g. a sequence shard's.

        The engine's data-efficiency arguments (DeepSpeed's names): ``curriculum_seqlen`` keeps the first
        that many tokens of ``idx``, ``targets`` and ``position_ids`` (Megatron's sequence-length curriculum);
        ``progressive_layer_drop`` with ``pld_theta`` skips block ``i`` with probability ``i * (1 - theta) / L``
        in training (stochastic depth as in DeepSpeed's PLD BERT example; the first block always runs)."""
        if curriculum_seqlen is not None and curriculum_seqlen < idx.size(1):
            idx = idx[:, :curriculum_seqlen]
            targets = None if targets is None else targets[:, :curriculum_seqlen]
            position_ids = None if position_ids is None else position_ids[..., :curriculum_seqlen]
        t = idx.size(1)
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device) if position_ids is None else position_ids
        if position_ids is not None and int(pos.max()) >= self.config.block_size:
            raise ValueError(f"position {int(pos.max())} exceeds block_size {self.config.block_size}")
        x = self.drop(self.wte(idx) + self.wpe(pos))
        if progressive_layer_drop and self.training:
            x = self._drop_layers(x, pld_theta)
        else:
            for block in self.blocks:
                x = block(x)
        if targets is not None and self.config.tiled_loss_shards > 1:
            loss = fused_logits_loss(self.ln_f(x), self.lm_head, shift_labels=targets,
                                     shards=self.config.tiled_loss_shards)
            return None, loss
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss
