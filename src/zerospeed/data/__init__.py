"""The demo corpus and a byte-level dataset over it.

``corpus.txt`` (about 1 MB of English from Python's own documentation, PSF License; see ``CORPUS_NOTICE.txt``)
ships with the package so that the demo, tests and benchmarks need no download. ``ByteDataset`` cuts a byte
string into fixed windows: item ``i`` is ``(x, y)`` with ``y`` the bytes of ``x`` shifted by one. The first
``1 - val_fraction`` of the bytes is the train split, the rest the val split, so the two never overlap.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from typing import Literal

import torch
from torch.utils.data import Dataset

__all__ = ["ByteDataset", "load_corpus"]


@lru_cache(maxsize=1)
def load_corpus() -> bytes:
    """The bundled corpus as raw bytes (UTF-8 text; one token per byte)."""
    return resources.files(__package__).joinpath("corpus.txt").read_bytes()


class ByteDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of ``block_size`` bytes and their next-byte targets, taken every ``stride`` bytes of one split."""

    def __init__(
        self,
        block_size: int,
        split: Literal["train", "val"] = "train",
        val_fraction: float = 0.1,
        stride: int | None = None,
        data: bytes | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        raw = load_corpus() if data is None else data
        cut = int(len(raw) * (1.0 - val_fraction))
        part = raw[:cut] if split == "train" else raw[cut:]
        self.tokens = torch.frombuffer(bytearray(part), dtype=torch.uint8).long()
        self.block_size = block_size
        self.stride = block_size if stride is None else stride
        if self.stride < 1:
            raise ValueError(f"stride must be >= 1, got {self.stride}")
        if len(self.tokens) <= block_size:
            raise ValueError(f"{split} split has {len(self.tokens)} bytes, needs more than block_size={block_size}")

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} windows")
        start = (index % len(self)) * self.stride
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]
