"""``SparseAttentionUtils``: DeepSpeed's helpers for putting sparse attention into a BERT or RoBERTa model.

Padding to a multiple of the block size, unpadding, longer position embeddings, the tokenizer's maximum
length, and swapping each encoder layer's self-attention for ``HFBertSparseSelfAttention``. The model
helpers work on transformers 5 ``Bert*`` / ``Roberta*`` models (``model.bert`` / ``model.roberta``, or the
bare ``BertModel`` / ``RobertaModel``); other models raise a ValueError naming the helper.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layouts import SparsityConfig
from .modules import HFBertSparseSelfAttention

_log = logging.getLogger("zerospeed.sparse_attention")


def _encoder_model(model: Any, helper: str) -> tuple[str, Any]:
    """``("bert" | "roberta", the inner model holding embeddings and encoder)``."""
    for kind in ("bert", "roberta"):
        if hasattr(model, kind):
            return kind, getattr(model, kind)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in ("bert", "roberta") and hasattr(model, "embeddings") and hasattr(model, "encoder"):
        return model_type, model
    raise ValueError(f"SparseAttentionUtils.{helper} supports BERT and RoBERTa models only (a model with a "
                     f"'bert' or 'roberta' attribute, or a BertModel/RobertaModel); got {type(model).__name__}")


def _resize_position_embedding(embeddings: nn.Module, weight: torch.Tensor) -> None:
    """Install ``weight`` as the position table and grow transformers' position/token-type id buffers."""
    table: nn.Embedding = embeddings.position_embeddings
    table.weight.data = weight.detach().clone()  # the same Parameter object (as DeepSpeed), new rows
    table.num_embeddings = weight.shape[0]
    n = weight.shape[0]
    if isinstance(getattr(embeddings, "position_ids", None), torch.Tensor):
        ids = embeddings.position_ids
        embeddings.position_ids = torch.arange(n, device=ids.device, dtype=ids.dtype).expand(1, -1)
    if isinstance(getattr(embeddings, "token_type_ids", None), torch.Tensor):
        tt = embeddings.token_type_ids
        embeddings.token_type_ids = torch.zeros((1, n), device=tt.device, dtype=tt.dtype)


class SparseAttentionUtils:
    """Static helpers (DeepSpeed's class and method names)."""

    @staticmethod
    def extend_position_embedding(model: Any, max_position: int) -> Any:
        """Tile the learned position embeddings to cover ``max_position`` positions (DeepSpeed's rule: the
        table repeats ``max(1, max_position // original)`` times; RoBERTa keeps its two reserved rows)."""
        kind, inner = _encoder_model(model, "extend_position_embedding")
        weight = inner.embeddings.position_embeddings.weight
        reserved = 2 if kind == "roberta" else 0
        original = weight.shape[0] - reserved
        if max_position <= original:
            raise ValueError(f"extend_position_embedding: max_position {max_position} must exceed the model's "
                             f"{original} positions")
        multiples = max(1, max_position // original)
        with torch.no_grad():
            tiled = weight[reserved:].repeat(multiples, 1)
            new = torch.cat([weight[:reserved], tiled]) if reserved else tiled
            if kind == "roberta":  # DeepSpeed sizes RoBERTa's table max_position + 2 (rows past the tiles unset)
                full = weight.new_zeros(max_position + 2, weight.shape[1])
                full[:new.shape[0]] = new[:max_position + 2]
                new = full
        _resize_position_embedding(inner.embeddings, new)
        model.config.max_position_embeddings = max_position + reserved
        _log.info("Extended position embeddings to %d", original * multiples)
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer: Any, max_position: int) -> Any:
        tokenizer.model_max_length = max_position
        tokenizer.init_kwargs["model_max_length"] = max_position
        return tokenizer

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(model: Any, max_position: int,
                                                                 sparsity_config: SparsityConfig | None = None) -> Any:
        """Swap every encoder layer's self-attention for a sparse one (weights kept, see
        ``replace_self_attention_layer_with_sparse_self_attention_layer``)."""
        kind, inner = _encoder_model(model, "replace_model_self_attention_with_sparse_self_attention")
        if getattr(model.config, "is_decoder", False):
            raise ValueError("replace_model_self_attention_with_sparse_self_attention: the model is a decoder "
                             "(is_decoder=True); sparse attention replaces bidirectional encoder attention only")
        model.config.max_position_embeddings = max_position + (2 if kind == "roberta" else 0)
        SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
            model.config, inner.encoder.layer, sparsity_config, max_seq_length=max_position)
        return model

    @staticmethod
    def replace_self_attention_layer_with_sparse_self_attention_layer(
            config: Any, layers: Any, sparsity_config: SparsityConfig | None = None, *,
            max_seq_length: int = 2048) -> Any:
        """Each ``layer.attention.self`` becomes an ``HFBertSparseSelfAttention`` sharing its query, key and
        value projections."""
        if sparsity_config is None:
            raise ValueError("replace_self_attention_layer_with_sparse_self_attention_layer needs a sparsity_config "
                             "(DeepSpeed's default SparsityConfig(num_heads=4) defines no layout)")
        block = sparsity_config.block
        length = max(2048, math.ceil(max_seq_length / block) * block)
        for layer in layers:
            old = layer.attention.self
            new = HFBertSparseSelfAttention(config, sparsity_config, max_seq_length=length)
            new.query, new.key, new.value = old.query, old.key, old.value
            new.sparse_self_attention.to(old.query.weight.device)
            layer.attention.self = new
        return layers

    @staticmethod
    def pad_to_block_size(block_size: int, input_ids: torch.Tensor | None, attention_mask: torch.Tensor,
                          token_type_ids: torch.Tensor, position_ids: torch.Tensor | None,
                          inputs_embeds: torch.Tensor | None, pad_token_id: int,
                          model_embeddings: Any) -> tuple[int, Any, Any, Any, Any, Any]:
        """Pad the sequence dimension up to a multiple of ``block_size``: ids and positions with
        ``pad_token_id``, the attention mask with 0 (padding is not attended), token types with 0, and
        ``inputs_embeds`` with the embeddings of pad tokens. Returns ``pad_len`` first."""
        batch_size, seq_len = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        pad_len = (block_size - seq_len % block_size) % block_size
        if pad_len > 0:
            if inputs_embeds is not None:
                pad_ids = inputs_embeds.new_full((batch_size, pad_len), pad_token_id, dtype=torch.long)
                inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids)], dim=-2)
            if input_ids is not None:
                input_ids = F.pad(input_ids, (0, pad_len), value=pad_token_id)
            if position_ids is not None:
                position_ids = F.pad(position_ids, (0, pad_len), value=pad_token_id)
            attention_mask = F.pad(attention_mask, (0, pad_len), value=False)
            token_type_ids = F.pad(token_type_ids, (0, pad_len), value=0)
        return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds

    @staticmethod
    def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
        return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output
