"""Model adapters: run a decoder one flat batch of tokens at a time, with attention handed in.

An adapter walks a model's own modules (embeddings, norms, projections, MLPs) but routes attention through
an ``attend(layer, q, k, v, scale)`` callable, so the same code serves a contiguous generate loop and the
paged, ragged serving engine: tokens of many sequences are concatenated into one ``[T]`` vector with their
``positions``; ``attend`` stores the new keys/values in the KV cache and attends each sequence's queries to
its own cached keys. Supported: ``zerospeed.models.GPT``, Hugging Face ``GPT2LMHeadModel`` and
``LlamaForCausalLM``. Anything else raises ``NotSupportedYetError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from abc import ABC, abstractmethod

import torch
from torch import nn

from zerospeed.config.errors import NotSupportedYetError

__all__ = ["Attend", "DecoderAdapter", "adapter_for"]

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""``attend(layer, q [T,H,D], k [T,Hkv,D], v [T,Hkv,D], scale) -> [T,H,D]``."""


class DecoderAdapter(ABC):
    """What the cache and the generate loops need to know about a model, and its flat forward."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int | None  # None: no learned position table (rotary)

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embedding().weight.device

    @abstractmethod
    def embedding(self) -> nn.Embedding:
        """The token embedding (its weight gives the model's dtype and device)."""

    @abstractmethod
    def hidden(self, ids: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Final hidden states ``[T, C]`` of flat tokens ``ids`` at ``pos``."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits of final hidden states."""


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.view(x.shape[0], -1, head_dim)


class ZeroSpeedGPTAdapter(DecoderAdapter):
    """``zerospeed.models.GPT``: learned positions, fused qkv, pre-LN blocks, tied head."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        cfg = model.config
        self.num_layers, self.num_heads, self.num_kv_heads = cfg.n_layer, cfg.n_head, cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.vocab_size, self.max_positions = cfg.vocab_size, cfg.block_size

    def embedding(self) -> nn.Embedding:
        return self.model.wte

    def hidden(self, ids: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        m = self.model
        x = m.wte(ids) + m.wpe(pos)
        scale = self.head_dim**-0.5
        for i, blk in enumerate(m.blocks):
            q, k, v = blk.attn.qkv(blk.ln1(x)).split(x.shape[-1], dim=-1)
            y = attend(i, _heads(q, self.head_dim), _heads(k, self.head_dim), _heads(v, self.head_dim), scale)
            x = x + blk.attn.proj(y.reshape(x.shape))
            x = x + blk.mlp(blk.ln2(x))
        return m.ln_f(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)


class GPT2Adapter(DecoderAdapter):
    """Hugging Face ``GPT2LMHeadModel``: Conv1D projections, learned positions, the attention's own scaling."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        cfg = model.config
        if getattr(cfg, "add_cross_attention", False):
            raise NotSupportedYetError("model", "GPT-2 with cross-attention: not supported yet by zerospeed")
        self.num_layers, self.num_heads = cfg.n_layer, cfg.n_head
        self.num_kv_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.vocab_size, self.max_positions = cfg.vocab_size, cfg.n_positions

    def embedding(self) -> nn.Embedding:
        return self.model.transformer.wte

    def hidden(self, ids: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        t = self.model.transformer
        x = t.wte(ids) + t.wpe(pos)
        for i, blk in enumerate(t.h):
            a = blk.attn
            q, k, v = a.c_attn(blk.ln_1(x)).split(a.split_size, dim=-1)
            y = attend(i, _heads(q, self.head_dim), _heads(k, self.head_dim), _heads(v, self.head_dim), a.scaling)
            x = x + a.c_proj(y.reshape(x.shape))
            x = x + blk.mlp(blk.ln_2(x))
        return t.ln_f(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAdapter(DecoderAdapter):
    """Hugging Face ``LlamaForCausalLM``: RMSNorm, rotary positions (the model's own rotary module), GQA."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        cfg = model.config
        self.num_layers, self.num_heads = cfg.num_hidden_layers, cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size, self.max_positions = cfg.vocab_size, None

    def embedding(self) -> nn.Embedding:
        return self.model.model.embed_tokens

    def hidden(self, ids: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        body = self.model.model
        x = body.embed_tokens(ids)
        cos, sin = body.rotary_emb(x[None], pos[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [T, 1, D]: broadcast over heads
        for i, layer in enumerate(body.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = (_heads(p(h), self.head_dim) for p in (a.q_proj, a.k_proj, a.v_proj))
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            y = attend(i, q, k, v, a.scaling)
            x = x + a.o_proj(y.reshape(y.shape[0], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return body.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)


def adapter_for(model: nn.Module) -> DecoderAdapter:
    """The adapter for ``model``, or ``NotSupportedYetError`` naming its class."""
    from zerospeed.models.gpt import GPT

    if isinstance(model, GPT):
        return ZeroSpeedGPTAdapter(model)
    cfg: Any = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind == "gpt2" and hasattr(model, "transformer") and hasattr(model, "lm_head"):
        return GPT2Adapter(model)
    if kind == "llama" and hasattr(model, "model") and hasattr(model, "lm_head"):
        return LlamaAdapter(model)
    raise NotSupportedYetError(
        "model", f"KV-cache decoding of {type(model).__name__} (model_type={kind!r}): not supported yet by zerospeed; "
        "built for zerospeed.models.GPT, GPT2LMHeadModel and LlamaForCausalLM")
