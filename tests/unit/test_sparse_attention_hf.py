"""SparseAttentionUtils on transformers 5 BERT and RoBERTa models built from tiny configs."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from zerospeed.ops.sparse_attention import (  # noqa: E402
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparseAttentionUtils,
)
from zerospeed.sparse_attention import HFBertSparseSelfAttention  # noqa: E402


def tiny(kind: str, attn: str = "eager"):
    cls = transformers.BertConfig if kind == "bert" else transformers.RobertaConfig
    cfg = cls(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=66 if kind == "roberta" else 64, attention_probs_dropout_prob=0.0,
              hidden_dropout_prob=0.0, pad_token_id=1, attn_implementation=attn)
    torch.manual_seed(0)
    model_cls = transformers.BertForMaskedLM if kind == "bert" else transformers.RobertaForMaskedLM
    return model_cls(cfg).eval()


@pytest.mark.parametrize("kind,attn", [("bert", "eager"), ("bert", "sdpa"), ("roberta", "eager")])
def test_dense_layout_replacement_keeps_the_model_output(kind, attn) -> None:
    model = tiny(kind, attn)
    ids = torch.randint(2, 50, (2, 32), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, 25:] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, 64, DenseSparsityConfig(num_heads=4, block=16))
    inner = getattr(model, kind)
    assert all(isinstance(layer.attention.self, HFBertSparseSelfAttention) for layer in inner.encoder.layer)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1, :25], ref[1, :25], rtol=1e-5, atol=1e-5)  # padded positions are unused


def test_fixed_layout_trains_and_pads_to_block_size() -> None:
    model = tiny("bert")
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, 64, FixedSparsityConfig(num_heads=4, block=8, num_local_blocks=2))
    ids = torch.randint(2, 50, (2, 21), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    pad_len, ids_p, mask_p, types_p, pos_p, emb_p = SparseAttentionUtils.pad_to_block_size(
        8, ids, mask, torch.zeros_like(ids), None, None, 1, None)
    assert pad_len == 3 and ids_p.shape == (2, 24) and pos_p is None and emb_p is None
    assert (ids_p[:, 21:] == 1).all() and (mask_p[:, 21:] == 0).all() and (types_p == 0).all()
    out = model.bert(input_ids=ids_p, attention_mask=mask_p, token_type_ids=types_p).last_hidden_state
    out = SparseAttentionUtils.unpad_sequence_output(pad_len, out)
    assert out.shape == (2, 21, 32)
    out.sum().backward()
    assert model.bert.encoder.layer[0].attention.self.query.weight.grad is not None


def test_extend_position_embedding_and_tokenizer_length() -> None:
    bert = tiny("bert")
    old = bert.bert.embeddings.position_embeddings.weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(bert, 128)
    new = bert.bert.embeddings.position_embeddings.weight
    assert new.shape == (128, 32) and torch.equal(new[64:], old) and bert.config.max_position_embeddings == 128
    assert bert.bert.embeddings.position_ids.shape == (1, 128)
    bert(input_ids=torch.randint(2, 50, (1, 100)))  # positions past the old 64 now work
    roberta = tiny("roberta")
    old = roberta.roberta.embeddings.position_embeddings.weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(roberta, 128)
    new = roberta.roberta.embeddings.position_embeddings.weight
    assert new.shape == (130, 32) and torch.equal(new[2:66], old[2:]) and torch.equal(new[66:130], old[2:])
    assert roberta.config.max_position_embeddings == 130
    with pytest.raises(ValueError, match="BERT and RoBERTa models only"):
        SparseAttentionUtils.extend_position_embedding(torch.nn.Linear(2, 2), 128)

    class Tok:
        model_max_length, init_kwargs = 64, {}

    tok = SparseAttentionUtils.update_tokenizer_model_max_length(Tok(), 4096)
    assert tok.model_max_length == 4096 and tok.init_kwargs["model_max_length"] == 4096
