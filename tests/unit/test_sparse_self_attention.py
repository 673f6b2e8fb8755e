"""SparseSelfAttention equals dense softmax attention under the same block mask (forward and gradients),
with DeepSpeed's key-padding and attention masks in 'add' and 'mul' modes, and stores only listed blocks."""

import math

import pytest
import torch
import torch.nn.functional as F

from zerospeed.ops.sparse_attention import (
    BertSparseSelfAttention,
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparseSelfAttention,
    VariableSparsityConfig,
)
from zerospeed.sparse_attention import BlockTable, block_sparse_attention

B, H, L, D, BLK = 2, 4, 96, 8, 16


def qkv(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def dense_sdpa(q, k, v, layout, additive=None):
    """Masked dense attention through torch's SDPA: the block layout as -inf, plus an additive mask."""
    keep = layout.bool().repeat_interleave(BLK, 1).repeat_interleave(BLK, 2)[:, :L, :L]
    mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, float("-inf")).unsqueeze(0)
    if additive is not None:
        mask = mask + additive
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, g)


CONFIGS = [
    FixedSparsityConfig(H, BLK),
    FixedSparsityConfig(H, BLK, attention="unidirectional"),
    FixedSparsityConfig(H, BLK, different_layout_per_head=True, num_local_blocks=2, horizontal_global_attention=True,
                        num_different_global_patterns=2),
    VariableSparsityConfig(H, BLK, different_layout_per_head=True, num_random_blocks=1, local_window_blocks=[1, 3],
                           global_block_indices=[2], seed=0),
    BigBirdSparsityConfig(H, BLK, different_layout_per_head=True, num_random_blocks=2, seed=1),
    BSLongformerSparsityConfig(H, BLK, global_block_indices=[0, 4], global_block_end_indices=[1, 6]),
    DenseSparsityConfig(H, BLK),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: type(c).__name__)
def test_equals_masked_dense_sdpa_forward_and_backward(cfg) -> None:
    attn = SparseSelfAttention(cfg, max_seq_length=2 * L)
    q, k, v = qkv()
    out = attn(q, k, v)
    ref = dense_sdpa(q, k, v, attn.get_layout(L))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-8)
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_float32_and_key_given_transposed() -> None:
    attn = SparseSelfAttention(FixedSparsityConfig(H, BLK), max_seq_length=L)
    q, k, v = qkv(torch.float32)
    out = attn(q, k.transpose(-1, -2), v)  # DeepSpeed accepts key as (B, H, D, L)
    torch.testing.assert_close(out, dense_sdpa(q, k, v, attn.get_layout(L)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["add", "mul"])
def test_key_padding_and_attention_masks_in_both_modes(mode) -> None:
    attn = SparseSelfAttention(FixedSparsityConfig(H, BLK), key_padding_mask_mode=mode, attn_mask_mode=mode,
                               max_seq_length=L)
    q, k, v = qkv()
    g = torch.Generator().manual_seed(3)
    keep_keys = torch.ones(B, L, dtype=torch.float64)
    keep_keys[0, -20:] = 0  # the first sequence is padded
    keep_pairs = (torch.rand(L, L, generator=g) > 0.3).double()
    keep_pairs.fill_diagonal_(1)
    if mode == "mul":  # 0 drops, anything else keeps
        kp, am = keep_keys, keep_pairs
        additive = torch.zeros(B, 1, L, L, dtype=torch.float64)
        additive = additive.masked_fill(keep_keys[:, None, None, :] == 0, float("-inf"))
        additive = additive.masked_fill(keep_pairs == 0, float("-inf"))
    else:  # added to the scores
        kp = (1 - keep_keys) * -1e4
        am = torch.randn(L, L, generator=g, dtype=torch.float64)
        additive = kp[:, None, None, :] + am
    out = attn(q, k, v, key_padding_mask=kp.view(B, 1, 1, L), attn_mask=am)  # DeepSpeed squeezes (B,1,1,L)
    ref = dense_sdpa(q, k, v, attn.get_layout(L), additive)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-8)
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_relative_position_embedding_is_added_and_differentiated() -> None:
    attn = SparseSelfAttention(BigBirdSparsityConfig(H, BLK, num_random_blocks=1, seed=2), max_seq_length=L)
    q, k, v = qkv()
    rpe = torch.randn(1, H, L, L, dtype=torch.float64, requires_grad=True)
    out = attn(q, k, v, rpe=rpe)
    ref = dense_sdpa(q, k, v, attn.get_layout(L), rpe)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-8)
    for a, b in zip(grads(out, (q, rpe)), grads(ref, (q, rpe))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_shorter_sequence_uses_the_master_layout_prefix_and_errors() -> None:
    attn = SparseSelfAttention(FixedSparsityConfig(H, BLK), max_seq_length=4 * L)
    assert torch.equal(attn.get_layout(L), attn.master_layout[:, :L // BLK, :L // BLK])
    q, k, v = qkv()
    with pytest.raises(ValueError, match="dividable by Block size"):
        attn(q[:, :, :40], k[:, :, :40], v[:, :, :40])
    with pytest.raises(NotImplementedError, match="self-attention"):
        attn(q, k[:, :, :, :4], v)
    with pytest.raises(ValueError, match="heads"):
        attn(q[:, :2], k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match="'add' or 'mul'"):
        SparseSelfAttention(FixedSparsityConfig(H, BLK), key_padding_mask_mode="max")
    with pytest.raises(ValueError, match="max_seq_length"):
        SparseSelfAttention(FixedSparsityConfig(H, BLK), max_seq_length=L).get_layout(2 * L)


def test_only_listed_blocks_are_computed() -> None:
    """Every saved activation is O(nnz blocks): at 1,024 tokens with a sliding window the largest tensor
    autograd keeps is far below one (L x L) score matrix per head."""
    seq, heads, dim, blk = 1024, 2, 8, 16
    cfg = BSLongformerSparsityConfig(heads, blk, num_sliding_window_blocks=3, global_block_indices=[])
    table = BlockTable.from_layout(cfg.make_layout(seq), blk)
    assert table.nnz == heads * (3 * (seq // blk) - 2)
    q, k, v = (torch.randn(1, heads, seq, dim, requires_grad=True) for _ in range(3))
    largest = 0

    def pack(t):
        nonlocal largest
        largest = max(largest, t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block_sparse_attention(q, k, v, table, dim ** -0.5)
    dense_scores = heads * seq * seq
    assert largest <= table.nnz * blk * blk < dense_scores / 10
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_half_precision_softmax_in_fp32() -> None:
    attn = SparseSelfAttention(FixedSparsityConfig(H, BLK), max_seq_length=L)
    q, k, v = qkv(torch.float32)
    out = attn(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), attn(q, k, v), rtol=0.05, atol=0.05)


def test_bert_sparse_self_attention_with_dense_layout_equals_bert_attention() -> None:
    class Cfg:
        hidden_size, num_attention_heads = 32, 4

    torch.manual_seed(0)
    layer = BertSparseSelfAttention(Cfg(), DenseSparsityConfig(num_heads=4, block=16), max_seq_length=64)
    assert layer.sparse_self_attention.sparsity_config.num_heads == 4
    x = torch.randn(2, 48, 32)
    mask = torch.zeros(2, 1, 1, 48)
    mask[1, ..., 40:] = -10000.0  # BERT's extended additive mask
    out = layer(x, mask)

    def split(t):
        return t.view(2, 48, 4, 8).transpose(1, 2)

    q, k, v = split(layer.query(x)), split(layer.key(x)), split(layer.value(x))
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8) + mask, dim=-1)
    ref = (probs @ v).transpose(1, 2).reshape(2, 48, 32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="multiple of the number of attention heads"):
        Cfg.hidden_size = 30
        BertSparseSelfAttention(Cfg())


def test_loading_a_state_dict_replaces_the_layout_in_use() -> None:
    a = SparseSelfAttention(BigBirdSparsityConfig(H, BLK, num_random_blocks=2, seed=1), max_seq_length=L)
    b = SparseSelfAttention(BigBirdSparsityConfig(H, BLK, num_random_blocks=2, seed=2), max_seq_length=L)
    q, k, v = qkv()
    b(q, k, v)  # builds b's block table
    assert not torch.equal(a.master_layout, b.master_layout)
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(b(q, k, v), a(q, k, v), rtol=0, atol=0)


def test_chunked_rows_give_the_same_result_with_one_chunk_alive() -> None:
    cfg = BigBirdSparsityConfig(H, BLK, different_layout_per_head=True, num_random_blocks=1, seed=4)
    full = SparseSelfAttention(cfg, max_seq_length=L)
    chunked = SparseSelfAttention(cfg, max_seq_length=L, chunk_blocks=5)
    table = chunked.block_table(L, torch.device("cpu"))
    parts = table.chunks(5)
    assert len(parts) > 4 and sum(sub.nnz for sub, _, _ in parts) == table.nnz
    assert [first for _, first, _ in parts] == sorted({first for _, first, _ in parts})
    assert sum(count for _, _, count in parts) == H * (L // BLK)
    q, k, v = qkv()
    rpe = torch.randn(1, H, L, L, dtype=torch.float64, requires_grad=True)
    kp = torch.zeros(B, L, dtype=torch.float64)
    kp[1, -30:] = -1e4
    out = chunked(q, k, v, rpe=rpe, key_padding_mask=kp)
    ref = full(q, k, v, rpe=rpe, key_padding_mask=kp)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-8)
    for a, b in zip(grads(out, (q, k, v, rpe)), grads(ref, (q, k, v, rpe))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    with torch.no_grad():
        torch.testing.assert_close(chunked(q, k, v), full(q, k, v), rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match="chunk_blocks"):
        SparseSelfAttention(cfg, chunk_blocks=0)
