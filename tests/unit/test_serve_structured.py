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
