"""Model adapters: run a decoder one flat batch of tokens at a time, with attention handed in.

An adapter walks a model's own modules (embeddings, norms, projections, MLPs) but routes attention through
an ``attend(layer, q, k, v, scale)`` callable, so the same code serves a contiguous generate loop and the
paged, ragged serving engine: tokens of many sequences are concatenated into one ``[T]`` vector with their
``positions``; ``attend`` stores the new keys/values in the KV cache and attends each sequence's queries to
its own cached keys. Supported: ``zerospeed.models.GPT``, Hugging Face ``GPT2LMHeadModel`` and
``LlamaForCausalLM``. Anything else raises ``NotSupportedYetError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.config.errors import NotSupportedYetError

from .compiled import CompiledRegion
from .fused_weights import FusedLinears
from .gemm import linear as _gemm
from .gemm import linear_add as _gemm_add

__all__ = ["Attend", "DecoderAdapter", "adapter_for"]

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""``attend(layer, q [T,H,D], k [T,Hkv,D], v [T,Hkv,D], scale) -> [T,H,D]``."""


class DecoderAdapter(ABC):
    """What the cache and the generate loops need to know about a model, and its flat forward.

    A forward is ``embed``, then per block ``pre_attention`` -> ``attend`` -> ``post_attention``, then
    ``logits`` (final norm + head). The three region methods are pure (no cache writes), so ``compile``
    can swap them for ``torch.compile``'d versions (see ``compiled``); ``attend`` always runs eagerly.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int | None  # None: no learned position table (rotary)

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._pre: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = self.pre_attention
        self._post: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = self.post_attention
        self._head: Callable[[torch.Tensor], torch.Tensor] = self.head
        self.regions: list[CompiledRegion] = []

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
    def blocks(self) -> Sequence[nn.Module]:
        """The transformer blocks, in order."""

    @abstractmethod
    def embed(self, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Input hidden states ``[T, C]`` and per-forward extras handed to every ``pre_attention`` (rotary)."""

    @abstractmethod
    def pre_attention(self, block: nn.Module, x: torch.Tensor, *extra: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Region 1: ``q [T,H,D], k, v [T,Hkv,D]`` of block input ``x`` (norm, projections, rotary)."""

    @abstractmethod
    def attention_scale(self, block: nn.Module) -> float:
        """The softmax scale of ``block``'s attention."""

    @abstractmethod
    def post_attention(self, block: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Region 2: the block output from its input ``x`` and attention output ``y [T,H,D]``."""

    @abstractmethod
    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Region 3: vocabulary logits of last-block outputs (final norm, LM head)."""

    @abstractmethod
    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm of last-block outputs (what ``head`` applies before the LM head; embeddings pool it)."""

    @abstractmethod
    def tp_plan(self) -> tuple[tuple[str, str], ...]:
        """Tensor-parallel cut of a block: ``(path in the block, kind)``, kind ``qkv`` (fused, cut per head
        group), ``column`` (output features) or ``row`` (input features, outputs all-reduced)."""

    def hidden(self, ids: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Last-block outputs ``[T, C]`` (before the final norm) of flat tokens ``ids`` at ``pos``."""
        x, extra = self.embed(ids, pos)
        for i, block in enumerate(self.blocks()):
            q, k, v = self._pre(block, x, *extra)
            x = self._post(block, x, attend(i, q, k, v, self.attention_scale(block)))
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits of rows of ``hidden``."""
        return self._head(hidden)

    def fuse(self) -> int:
        """Let linears that share an input run as one matmul (``fused_weights``); how many groups were fused."""
        return 0

    def compile(self, backend: str | Callable[..., Any] | None = None, options: dict[str, Any] | None = None) -> None:
        """Run the three regions through ``torch.compile`` (eager fallback per region on failure)."""
        pre, post, head = (CompiledRegion(fn, name, backend, options) for fn, name in (
            (self.pre_attention, "norm+qkv"), (self.post_attention, "out-proj+mlp"), (self.head, "norm+lm-head")))
        self._pre, self._post, self._head = pre, post, head
        self.regions = [pre, post, head]


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

    def blocks(self) -> Sequence[nn.Module]:
        return self.model.blocks

    def embed(self, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return self.model.wte(ids) + self.model.wpe(pos), ()

    def pre_attention(self, block: nn.Module, x: torch.Tensor, *extra: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = block.attn.qkv(block.ln1(x)).chunk(3, dim=-1)
        return _heads(q, self.head_dim), _heads(k, self.head_dim), _heads(v, self.head_dim)

    def attention_scale(self, block: nn.Module) -> float:
        return self.head_dim**-0.5

    def post_attention(self, block: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x + block.attn.proj(y.reshape(y.shape[0], -1))
        return x + block.mlp(block.ln2(x))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.ln_f(x))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.ln_f(x)

    def tp_plan(self) -> tuple[tuple[str, str], ...]:
        return (("attn.qkv", "qkv"), ("attn.proj", "row"), ("mlp.fc", "column"), ("mlp.proj", "row"))


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

    def blocks(self) -> Sequence[nn.Module]:
        return self.model.transformer.h

    def embed(self, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        t = self.model.transformer
        return t.wte(ids) + t.wpe(pos), ()

    def pre_attention(self, block: nn.Module, x: torch.Tensor, *extra: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = block.attn.c_attn(block.ln_1(x)).chunk(3, dim=-1)
        return _heads(q, self.head_dim), _heads(k, self.head_dim), _heads(v, self.head_dim)

    def attention_scale(self, block: nn.Module) -> float:
        return block.attn.scaling

    def post_attention(self, block: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x + block.attn.c_proj(y.reshape(y.shape[0], -1))
        return x + block.mlp(block.ln_2(x))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.transformer.ln_f(x))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.transformer.ln_f(x)

    def tp_plan(self) -> tuple[tuple[str, str], ...]:
        return (("attn.c_attn", "qkv"), ("attn.c_proj", "row"), ("mlp.c_fc", "column"), ("mlp.c_proj", "row"))


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``LlamaRMSNorm`` as one fused op in fp32 (its own forward otherwise)."""
    if type(norm).__name__ != "LlamaRMSNorm" or x.dtype != torch.float32 or norm.weight.dtype != torch.float32:
        return norm(x)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _is_silu(act: nn.Module) -> bool:
    """``nn.SiLU`` or Hugging Face's ``SiLUActivation`` (whose forward is ``F.silu``), known by name so that
    importing this module does not import transformers."""
    t = type(act)
    return t is nn.SiLU or (t.__name__ == "SiLUActivation" and t.__module__ == "transformers.activations")


def _plain(mod: nn.Module) -> bool:
    return type(mod) is nn.Linear and not (mod._forward_hooks or mod._forward_pre_hooks)


def _linear(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``mod(x)``; a plain hook-free ``nn.Linear`` runs as a bare matmul (no module dispatch per layer; through
    oneDNN where that is faster, see ``gemm``)."""
    return _gemm(x, mod.weight, mod.bias) if _plain(mod) else mod(x)


def _residual_linear(x: torch.Tensor, mod: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """``x + mod(y)``, the add folded into the matmul where ``gemm`` can."""
    return _gemm_add(x, y, mod.weight, mod.bias) if _plain(mod) else x + mod(y)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``x * cos + rotate_half(x) * sin`` in three ops: ``rotate_half(x) * sin`` is
    ``roll(x, half) * signed_sin`` with the first half of ``sin`` negated (sign flips are exact)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


def _cos_signed_sin(rotary: nn.Module, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary ``cos`` and ``sin`` at positions ``pos`` (``[T, D]``), the first half of ``sin``
    negated (see ``_rotate``)."""
    cos, sin = rotary(x[None], pos[None])
    half = sin.shape[-1] // 2
    return cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)


class LlamaAdapter(DecoderAdapter):
    """Hugging Face ``LlamaForCausalLM``: RMSNorm, rotary positions (the model's own rotary module), GQA."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        cfg = model.config
        self.num_layers, self.num_heads = cfg.num_hidden_layers, cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size, self.max_positions = cfg.vocab_size, None
        self._rope: tuple[Any, torch.Tensor, torch.Tensor] | None = None  # (inv_freq key, cos, signed sin)

    def embedding(self) -> nn.Embedding:
        return self.model.model.embed_tokens

    def blocks(self) -> Sequence[nn.Module]:
        return self.model.model.layers

    def embed(self, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        x = self.model.model.embed_tokens(ids)
        rot = self.model.model.rotary_emb
        if getattr(rot, "rope_type", "default") != "default" or not isinstance(rot.inv_freq, torch.Tensor):
            cos, signed_sin = _cos_signed_sin(rot, x, pos)  # e.g. dynamic scaling: the module every forward
        else:  # rows of a table made by the model's own module (per position, so the same values), 2 ops
            key = (rot.inv_freq.data_ptr(), rot.inv_freq._version, x.dtype, x.device)
            top = int(pos.max()) + 1
            if self._rope is None or self._rope[0] != key or self._rope[1].shape[0] < top:
                n = max(256, 1 << (top - 1).bit_length())
                self._rope = (key, *_cos_signed_sin(rot, x, torch.arange(n, device=pos.device)))
            cos, signed_sin = self._rope[1].index_select(0, pos), self._rope[2].index_select(0, pos)
        return x, (cos[:, None, :], signed_sin[:, None, :])  # [T, 1, D]: broadcast over heads

    def fuse(self) -> int:
        """q/k/v and gate/up of every block as one matmul each (weights re-pointed into one buffer, no copy)."""
        self._fused: dict[tuple[int, str], FusedLinears] = {}
        for block in self.blocks():
            a, m = block.self_attn, block.mlp
            for name, mods in (("qkv", (a.q_proj, a.k_proj, a.v_proj)), ("gate_up", (m.gate_proj, m.up_proj))):
                fused = FusedLinears.build(mods)
                if fused is not None:
                    self._fused[(id(block), name)] = fused
        return len(self._fused)

    def _fused_for(self, block: nn.Module, name: str, mods: tuple[nn.Module, ...]) -> FusedLinears | None:
        fused = getattr(self, "_fused", {}).get((id(block), name))
        return fused if fused is not None and fused.valid(mods) else None

    def pre_attention(self, block: nn.Module, x: torch.Tensor, *extra: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cos, signed_sin = extra
        a = block.self_attn
        h = _rms_norm(block.input_layernorm, x)
        mods = (a.q_proj, a.k_proj, a.v_proj)
        fused = self._fused_for(block, "qkv", mods)
        if fused is not None:  # q and k are neighbours in the fused output: rotate them as one view, no cat
            out = fused.linear(h)
            nq, nk = mods[0].out_features, mods[1].out_features
            qk, v = _heads(out[:, : nq + nk], self.head_dim), _heads(out[:, nq + nk:], self.head_dim)
        else:
            q, k, v = (_heads(y, self.head_dim) for y in (p(h) for p in mods))
            nq, qk = q.shape[1] * self.head_dim, torch.cat((q, k), dim=1)  # one rotation for queries and keys
        qk = _rotate(qk, cos, signed_sin)
        heads = nq // self.head_dim
        return qk[:, :heads], qk[:, heads:], v

    def attention_scale(self, block: nn.Module) -> float:
        return block.self_attn.scaling

    def post_attention(self, block: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = _residual_linear(x, block.self_attn.o_proj, y.reshape(y.shape[0], -1))
        m = block.mlp
        if type(m).__name__ != "LlamaMLP":
            return x + m(block.post_attention_layernorm(x))
        h = _rms_norm(block.post_attention_layernorm, x)
        mods = (m.gate_proj, m.up_proj)
        fused = self._fused_for(block, "gate_up", mods)
        if fused is not None:  # gate and up are two views of one matmul's output (no split call)
            out, n = fused.linear(h), fused.sizes[0]
            gate, up = out[:, :n], out[:, n:]
        else:
            gate, up = mods[0](h), mods[1](h)
        act = F.silu(gate) if _is_silu(m.act_fn) else m.act_fn(gate)
        return _residual_linear(x, m.down_proj, act.mul_(up) if act is not gate else act * up)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self.model.lm_head, _rms_norm(self.model.model.norm, x))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(self.model.model.norm, x)

    def tp_plan(self) -> tuple[tuple[str, str], ...]:
        return (("self_attn.q_proj", "column"), ("self_attn.k_proj", "column"), ("self_attn.v_proj", "column"),
                ("self_attn.o_proj", "row"), ("mlp.gate_proj", "column"), ("mlp.up_proj", "column"),
                ("mlp.down_proj", "row"))


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
