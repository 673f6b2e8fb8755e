"""Structured output: json_object's bounded-depth regex, the on-disk index cache, the byte-level BPE vocabulary."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("outlines_core")

from zerospeed.inference import structured  # noqa: E402
from zerospeed.inference.structured import StructuredOutput, json_object_regex  # noqa: E402


def test_json_object_regex_nests_to_its_depth():
    r2, r3 = json_object_regex(2), json_object_regex(3)
    for text, depth in [('{}', 1), ('{"a": 1, "b": "x"}', 1), ('{"a": [1, 2], "b": {"c": true}}', 2),
                        ('{"a": {"b": [1, "x"]}}', 3), ('{"a": [1, {"c": null}], "d": -1.5e+3}', 3)]:
        assert bool(re.fullmatch(r2, text)) == (depth <= 2), text
        assert re.fullmatch(r3, text), text
        json.loads(text)
    for bad in ('{"a": {"b": {"c": {}}}}', '[1]', '{"a": 1,}', '{"a" 1}'):
        assert not re.fullmatch(r3, bad), bad
    assert structured.regex_for("json", None) == r3


def test_index_cache_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROSPEED_STRUCTURED_CACHE", str(tmp_path))
    first = StructuredOutput(object(), 256)
    regex = json_object_regex(2)
    first.index(regex)
    assert len(list(tmp_path.glob("*.index"))) == 1

    import outlines_core

    class NoCompile:
        from_binary = staticmethod(outlines_core.Index.from_binary)

        def __init__(self, *args):
            raise AssertionError("compiled again instead of loading the cache")

    monkeypatch.setattr(outlines_core, "Index", NoCompile)
    second = StructuredOutput(object(), 256)  # a new server: the index comes from disk
    guide = second.spec(regex).new()
    for b in b'{"a": [1]}':
        assert b in guide.get_tokens()
        guide.advance(b)
    assert guide.is_finished()
    other = StructuredOutput(object(), 128)  # another vocabulary: its own file
    monkeypatch.undo()
    monkeypatch.setenv("ZEROSPEED_STRUCTURED_CACHE", str(tmp_path))
    other.index(regex)
    assert len(list(tmp_path.glob("*.index"))) == 2


def test_byte_level_bpe_vocabulary(monkeypatch):
    """A tiny byte-level BPE (GPT-2's byte alphabet): token bytes are decoded right and the JSON walks through."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("ZEROSPEED_STRUCTURED_CACHE", "")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(['{"name": "caf\u00e9", "tags": ["a", "b"], "n": 12}'] * 50, trainer)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    eos = tok.convert_tokens_to_ids("<eos>")
    so = StructuredOutput(tok, len(tok), (eos,))
    table = so._token_bytes()
    by_id = {i: b for b, ids in table.items() for i in ids}
    assert eos not in by_id and len(by_id) == len(tok) - 1
    assert all(by_id[tok.convert_tokens_to_ids(c)] == bytes([b]) for b, c in structured._bytes_to_unicode().items())
    text = '{"name": "caf\u00e9", "tags": ["a", 1]}'
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())  # merges are used, not only single bytes
    assert b"".join(by_id[i] for i in ids) == text.encode()
    guide = so.spec(json_object_regex(2)).new()  # depth 2: compiles in ~0.2 s
    for i in ids:
        assert i in guide.get_tokens()
        guide.advance(i)
    assert guide.is_finished() and eos in guide.get_tokens()


def _sentencepiece_tokenizer():
    """A Llama-style SentencePiece BPE built here (no download): ``<0xNN>`` byte fallback for all 256 bytes, ``▁``
    for a space, and text pieces holding non-ASCII characters ("é", "ü": UTF-8, not GPT-2's byte alphabet)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["\u2581", "a", "c", "f", "é", "!", "ü", "ca", "\u2581a", "\u2581ca", "\u2581caf", "\u2581café", "é!"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("\u2581", "a"), ("c", "a"), ("\u2581", "ca"), ("\u2581ca", "f"), ("\u2581caf", "é"), ("é", "!")]
    sp = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")


def test_sentencepiece_byte_fallback_vocabulary(monkeypatch):
    """Every token's bytes are what the tokenizer decodes it to, and constrained decoding walked over those bytes
    (merged pieces, "é" as a piece and as two <0xNN> bytes, a 3-byte character only as bytes) decodes to exactly
    the text the structure allows."""
    import torch

    monkeypatch.setenv("ZEROSPEED_STRUCTURED_CACHE", "")
    tok = _sentencepiece_tokenizer()
    eos = tok.convert_tokens_to_ids("</s>")
    so = StructuredOutput(tok, len(tok), (eos,))
    by_id = {i: b for b, ids in so._token_bytes().items() for i in ids}
    anchor = tok.convert_tokens_to_ids("a")  # decoded after an anchor: the leading-space strip does not apply
    for i, b in by_id.items():
        if len(b) > 1 or b[0] < 0x80:  # a lone byte of a multi-byte character decodes to U+FFFD
            assert tok.decode([anchor, i]).encode() == b"a" + b, (tok.convert_ids_to_tokens(i), b)
    assert by_id[tok.convert_tokens_to_ids("é")] == "é".encode() and by_id[tok.convert_tokens_to_ids("ü")] == b"\xc3\xbc"
    assert by_id[tok.convert_tokens_to_ids("<0xC3>")] == b"\xc3" and by_id[tok.convert_tokens_to_ids("\u2581")] == b" "
    allowed = ["café é! ü ☃", "ca é", "aa ü!"]
    spec = so.spec(structured.regex_for("choice", allowed))
    gen = torch.Generator().manual_seed(0)
    for _ in range(12):  # random walks through the mask: the decoded text is always one of the choices, exactly
        guide, ids = spec.new(), []
        while options := [t for t in guide.get_tokens() if t != eos]:
            ids.append(options[int(torch.randint(len(options), (1,), generator=gen))])
            guide.advance(ids[-1])
        assert spec.finished(guide)
        text = b"".join(by_id[i] for i in ids)
        assert text.decode() in allowed
        assert tok.decode([anchor, *ids]) == "a" + text.decode()
