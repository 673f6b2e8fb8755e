"""A stand-in for the slice of Hugging Face ``datasets`` DeepSpeedExamples' HelloDeepSpeed uses, for machines
that cannot download WikiText: ``load_dataset("wikitext", ...)`` serves zerospeed's bundled corpus in 400-character
paragraphs, with ``filter`` / ``map`` / indexing. Not part of zerospeed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Dataset:
    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.records[i]

    def filter(self, fn: Callable[[dict[str, Any]], bool]) -> Dataset:
        return Dataset([r for r in self.records if fn(r)])

    def map(self, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Dataset:
        return Dataset([{**r, **fn(r)} for r in self.records])


def load_dataset(name: str, config: str | None = None, split: str = "train", **_: Any) -> Dataset:
    if name != "wikitext":
        raise ValueError(f"the offline stand-in serves only 'wikitext', not {name!r}")
    from zerospeed.data import load_corpus

    text = " ".join(load_corpus().decode("utf-8", errors="replace").split())
    paragraphs = [text[i:i + 400] for i in range(0, len(text) - 400, 400)]  # WikiText records are paragraphs
    cut = int(len(paragraphs) * 0.9)
    part = paragraphs[:cut] if split == "train" else paragraphs[cut:]
    return Dataset([{"text": p + "\n"} for p in part])


class _ArrowDatasetModule:
    """``datasets.arrow_dataset.Dataset``, the name the script's type hints use."""

    Dataset = Dataset


arrow_dataset = _ArrowDatasetModule()
