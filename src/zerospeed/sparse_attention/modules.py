"""``SparseSelfAttention`` and ``BertSparseSelfAttention``: DeepSpeed's modules, computed block-wise in PyTorch.

``SparseSelfAttention`` holds the layout of its sparsity config for ``max_seq_length`` tokens (a buffer,
``master_layout``) and, for a batch of length ``L``, attends over the layout's first ``L / block`` blocks
(``block_sparse.py``: memory and work grow with the number of listed blocks, not with ``L²``). It runs on
any device and dtype (DeepSpeed's Triton kernels took fp16 on CUDA only); gradients flow to query, key,
value and ``rpe``. Masks follow DeepSpeed: ``key_padding_mask`` (B, L) and ``attn_mask`` (L, L) are
added (``"add"``) or, in ``"mul"`` mode, entries equal to 0 drop the key (-inf) and others keep it; a
boolean mask always means keep (True) / drop (False).
``attn_mask`` may also be (B|1, H|1, L, L) here (zerospeed extension, used for Hugging Face masks).

``chunk_blocks`` (zerospeed only) bounds memory further: whole rows at most that many blocks at a time,
each chunk recomputed in backward (activation checkpointing), so memory is the inputs plus one chunk, for
about one extra forward pass of work.

When torch.distributed is initialised and the layout has random blocks drawn from the global ``random``
(no ``seed=``), the first forward broadcasts the layout from global rank 0 over the world (DeepSpeed does so
for every layout), so all ranks compute the same pattern; every rank must then run that first forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .block_sparse import BlockTable, block_sparse_attention
from .layouts import FixedSparsityConfig, SparsityConfig

_MODES = ("add", "mul")


def _additive(mask: torch.Tensor, mode: str, dtype: torch.dtype) -> torch.Tensor:
    """A mask in DeepSpeed's ``mode`` as an additive one: ``mul`` turns 0 into -inf and the rest into 0."""
    if mode == "mul" or mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask == 0, float("-inf"))
    return mask.to(dtype)


class SparseSelfAttention(nn.Module):
    """Block-sparse self-attention of (batch, heads, seq, head_dim) query, key and value."""

    def __init__(self, sparsity_config: SparsityConfig | None = None, key_padding_mask_mode: str = "add",
                 attn_mask_mode: str = "mul", max_seq_length: int = 2048, *,
                 chunk_blocks: int | None = None) -> None:
        super().__init__()
        if chunk_blocks is not None and chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be a positive number of blocks or None, got {chunk_blocks}")
        self.chunk_blocks = chunk_blocks
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in _MODES:
                raise ValueError(f"{name}={mode!r}: use 'add' or 'mul'")
        # DeepSpeed's default, SparsityConfig(num_heads=4), has no layout; the fixed pattern is the useful one
        self.sparsity_config = sparsity_config if sparsity_config is not None else FixedSparsityConfig(num_heads=4)
        self.register_buffer("master_layout", self.sparsity_config.make_layout(max_seq_length))
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        # random blocks drawn from the global ``random`` differ per rank; a ``seed=`` stream does not
        self._need_layout_synchronization = bool(getattr(self.sparsity_config, "num_random_blocks", 0)) and \
            getattr(self.sparsity_config, "seed", None) is None
        self._tables: dict[tuple[int, str], BlockTable] = {}

    def get_layout(self, L: int) -> torch.Tensor:  # noqa: N803 - DeepSpeed's name
        """The layout for ``L`` tokens: the master layout's first ``L / block`` blocks."""
        if self._need_layout_synchronization:
            self._synchronize_layout()
        block = self.sparsity_config.block
        if L % block != 0:
            raise ValueError(f"Sequence Length, {L}, needs to be dividable by Block size {block}!")
        nb = L // block
        if nb > self.master_layout.shape[-1]:
            raise ValueError(f"sequence length {L} is longer than max_seq_length "
                             f"{self.master_layout.shape[-1] * block} this SparseSelfAttention was built for")
        return self.master_layout[..., :nb, :nb].cpu()

    def _synchronize_layout(self) -> None:
        from .. import comm

        if comm.is_initialized():
            comm.broadcast(self.master_layout, src=0, group=None)
            self._tables.clear()
        self._need_layout_synchronization = False

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._tables.clear()  # a loaded master layout replaces the one the cached tables were built from
        self._need_layout_synchronization = False  # a checkpoint's layout is the same on every rank

    def block_table(self, L: int, device: torch.device) -> BlockTable:  # noqa: N803
        key = (L, str(device))
        if key not in self._tables:
            self._tables[key] = BlockTable.from_layout(self.get_layout(L), self.sparsity_config.block, device)
        return self._tables[key]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rpe: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention context (B, H, L, D). ``key`` may also come transposed, (B, H, D, L), as in DeepSpeed."""
        bsz, heads, seq, head_dim = query.shape
        if key.dim() == 4 and key.shape[2] != seq:
            key = key.transpose(-1, -2)
        if query.shape != key.shape or key.shape != value.shape:
            raise NotImplementedError(f"only self-attention is supported: query {tuple(query.shape)}, key "
                                      f"{tuple(key.shape)} and value {tuple(value.shape)} must have one shape")
        if heads != self.sparsity_config.num_heads:
            raise ValueError(f"query has {heads} heads but the sparsity config has num_heads="
                             f"{self.sparsity_config.num_heads}")
        dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
        if key_padding_mask is not None:  # DeepSpeed squeezes e.g. (B, 1, 1, L) to (B, L)
            key_padding_mask = key_padding_mask.reshape(key_padding_mask.shape[0], -1)
            key_padding_mask = _additive(key_padding_mask, self.key_padding_mask_mode, dtype)
        if attn_mask is not None:
            attn_mask = _additive(attn_mask, self.attn_mask_mode, dtype)
        table = self.block_table(seq, query.device)
        return block_sparse_attention(query, key, value, table, float(head_dim) ** -0.5, rpe=rpe,
                                      key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                      chunk_blocks=self.chunk_blocks)


class BertSparseSelfAttention(nn.Module):
    """BERT's self-attention with the scores computed by ``SparseSelfAttention`` (DeepSpeed's bing_bert layer):
    query/key/value projections, then sparse attention with ``attention_mask`` as the key padding mask
    (additive, e.g. BERT's extended (B, 1, 1, L) mask). No attention dropout, as in DeepSpeed."""

    def __init__(self, config: Any, sparsity_config: SparsityConfig | None = None, *,
                 max_seq_length: int = 2048) -> None:
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(f"The hidden size ({config.hidden_size}) is not a multiple of the number of attention "
                             f"heads ({config.num_attention_heads})")
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        if sparsity_config is None:  # DeepSpeed's default is 4 heads whatever the model has; use the model's
            sparsity_config = FixedSparsityConfig(num_heads=config.num_attention_heads)
        self.sparse_self_attention = SparseSelfAttention(sparsity_config, max_seq_length=max_seq_length)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def _context(self, hidden_states: torch.Tensor, **masks: torch.Tensor | None) -> torch.Tensor:
        q, k, v = (self.transpose_for_scores(p(hidden_states)) for p in (self.query, self.key, self.value))
        context = self.sparse_self_attention(q, k, v, **masks)
        return context.permute(0, 2, 1, 3).reshape(*hidden_states.shape[:-1], self.all_head_size)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return self._context(hidden_states, key_padding_mask=attention_mask)


class HFBertSparseSelfAttention(BertSparseSelfAttention):
    """The drop-in for a transformers 5 ``BertSelfAttention`` / ``RobertaSelfAttention``: takes the layer's
    call (``attention_mask`` as the model's 4-D mask, additive or boolean) and returns
    ``(context, None)``. Encoder self-attention only (no cross-attention, no KV cache)."""

    def __init__(self, config: Any, sparsity_config: SparsityConfig | None = None, *,
                 max_seq_length: int = 2048) -> None:
        super().__init__(config, sparsity_config, max_seq_length=max_seq_length)
        self.sparse_self_attention.attn_mask_mode = "add"  # transformers' float masks are additive

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,  # type: ignore[override]
                encoder_hidden_states: torch.Tensor | None = None, cache: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
        if encoder_hidden_states is not None or cache is not None or kwargs.get("past_key_values") is not None:
            raise NotImplementedError("BertSparseSelfAttention replaces encoder self-attention only; cross-attention "
                                      "and KV caches are not supported by sparse attention")
        return self._context(hidden_states, attn_mask=attention_mask), None
