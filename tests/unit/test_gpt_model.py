"""The demo GPT and its byte dataset: shapes, initial loss, tying, determinism, counts."""

import math

import pytest
import torch

from zerospeed.data import ByteDataset, load_corpus
from zerospeed.models import GPT, PRESETS, GPTConfig, tiny


def _expected_params(c: GPTConfig) -> int:
    d, b = c.n_embd, int(c.bias)
    per_block = (
        2 * (d + b * d)  # two LayerNorms
        + (3 * d * d + b * 3 * d)  # qkv
        + (d * d + b * d)  # attention out-projection
        + (4 * d * d + b * 4 * d)  # MLP up
        + (4 * d * d + b * d)  # MLP down
    )
    return c.vocab_size * d + c.block_size * d + c.n_layer * per_block + (d + b * d)


def test_forward_shapes_and_optional_loss() -> None:
    cfg = tiny()
    model = GPT(cfg)
    idx = torch.randint(0, 256, (3, cfg.block_size))
    logits, loss = model(idx)
    assert logits.shape == (3, cfg.block_size, 256) and loss is None
    logits, loss = model(idx[:, :5], idx[:, :5])
    assert logits.shape == (3, 5, 256) and loss is not None and loss.dim() == 0


def test_initial_loss_is_near_uniform() -> None:
    gen = torch.Generator().manual_seed(1)
    idx, tgt = (torch.randint(0, 256, (8, 32), generator=gen) for _ in range(2))
    _, loss = GPT(tiny())(idx, tgt)
    assert loss is not None
    assert abs(loss.item() - math.log(256)) < 0.1


def test_head_is_tied_to_token_embedding() -> None:
    model = GPT(tiny())
    assert model.lm_head.weight is model.wte.weight
    assert sum(1 for p in model.parameters() if p is model.wte.weight) == 1


@pytest.mark.parametrize("name", ["tiny", "demo", "bench"])
def test_param_count_matches_formula(name: str) -> None:
    cfg = PRESETS[name]()
    assert GPT(cfg).num_params() == _expected_params(cfg)


def test_preset_sizes() -> None:
    assert GPT(PRESETS["tiny"]()).num_params() < 100_000
    assert 1_000_000 < GPT(PRESETS["demo"]()).num_params() < 5_000_000


def test_init_is_deterministic_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = GPT(tiny(), seed=7)
    assert torch.equal(torch.rand(1), before)  # init drew from its own generator
    b, c = GPT(tiny(), seed=7), GPT(tiny(), seed=8)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_attention_is_causal() -> None:
    model = GPT(tiny()).eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    la, _ = model(idx)
    lb, _ = model(changed)
    assert torch.allclose(la[0, :10], lb[0, :10], atol=1e-6)
    assert not torch.allclose(la[0, 10:], lb[0, 10:])


def test_too_long_sequence_and_bad_config_raise() -> None:
    with pytest.raises(ValueError, match="block_size"):
        GPT(tiny())(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)


def test_byte_dataset_windows_and_split() -> None:
    data = bytes(range(100))
    train = ByteDataset(8, "train", val_fraction=0.2, data=data)
    val = ByteDataset(8, "val", val_fraction=0.2, data=data)
    assert len(train) == (80 - 9) // 8 + 1 and len(val) == (20 - 9) // 8 + 1
    x, y = train[1]
    assert x.tolist() == list(range(8, 16)) and y.tolist() == list(range(9, 17))
    assert val[0][0][0].item() == 80  # val starts where train ends
    last_x, last_y = train[len(train) - 1]
    assert last_y[-1].item() < 80
    with pytest.raises(IndexError):
        train[len(train)]


def test_bundled_corpus_is_english_text() -> None:
    corpus = load_corpus()
    assert 500_000 < len(corpus) < 1_500_000
    text = corpus.decode("utf-8")
    assert " the " in text and "Python" in text
