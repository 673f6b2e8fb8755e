"""Block-sparsity layouts: which (query block, key block) pairs each attention head computes.

A layout is an int64 tensor ``(num_heads, num_blocks, num_blocks)`` with ``num_blocks = seq_len // block``;
``layout[h, r, c] == 1`` means the queries of block ``r`` attend to the keys of block ``c`` in head ``h``.
The classes, their constructor arguments, defaults and rules are DeepSpeed's ``sparsity_config`` ones, and
``make_layout`` gives exactly DeepSpeed's layouts (including its quirks, noted where they appear):

* ``Dense``          every block.
* ``Fixed``          local windows of ``num_local_blocks`` (lower triangle only when unidirectional) plus
                     ``num_global_blocks`` global columns per window (rows too with ``horizontal_global_attention``);
                     heads may take different global blocks (``num_different_global_patterns``).
* ``Variable``       random blocks, a list of local window sizes, and global blocks at given indices/ranges.
* ``BigBird``        random blocks, a sliding window, and the first ``num_global_blocks`` rows and columns.
* ``BSLongformer``   a sliding window plus global rows and columns at given indices/ranges.
* ``LocalSlidingWindow``  a sliding window only (causal by default).

Random blocks come from Python's ``random`` module, as in DeepSpeed (``random.seed(s)`` before
``make_layout`` reproduces DeepSpeed's layout), or from a private ``random.Random(seed)`` when the
zerospeed-only keyword ``seed`` is given. Without ``different_layout_per_head`` head 0's layout is
copied to every head.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

_ATTENTION = ("unidirectional", "bidirectional")


def _check_attention(attention: str) -> str:
    if attention not in _ATTENTION:
        raise NotImplementedError(f"attention={attention!r}: only 'unidirectional' and 'bidirectional' "
                                  "attention are supported")
    return attention


def _check_global_ranges(starts: Sequence[int], ends: Sequence[int] | None) -> None:
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(f"global_block_indices has {len(starts)} entries but global_block_end_indices has "
                         f"{len(ends)}; they must have the same length")
    for s, e in zip(starts, ends):
        if s >= e:
            raise ValueError(f"global block start index {s} must be smaller than its end index {e}")


class SparsityConfig:
    """Shared settings of every layout: heads, block size, one layout or one per head."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False) -> None:
        if num_heads < 1 or block < 1:
            raise ValueError(f"num_heads ({num_heads}) and block ({block}) must be positive")
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An all-zero layout for ``seq_len`` tokens (which must be a multiple of ``block``)."""
        if seq_len % self.block != 0:
            raise ValueError(f"Sequence Length, {seq_len}, needs to be dividable by Block size {self.block}!")
        nb = seq_len // self.block
        return torch.zeros((self.num_heads, nb, nb), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        """One layout for all heads: copy head 0 into the others."""
        if not self.different_layout_per_head:
            layout[1:self.num_heads] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} defines no layout: use one of DenseSparsityConfig, "
                                  "FixedSparsityConfig, VariableSparsityConfig, BigBirdSparsityConfig, "
                                  "BSLongformerSparsityConfig, LocalSlidingWindowSparsityConfig")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class _Random:
    """DeepSpeed draws from the global ``random`` module; ``seed`` gives a private, reproducible stream."""

    seed: int | None

    def _rng(self) -> Any:
        return random if self.seed is None else random.Random(self.seed)


def _local_windows(layout: torch.Tensor, h: int, start: int, end: int, unidirectional: bool) -> None:
    """Blocks ``[start, end)`` attend to each other (only to earlier or equal blocks when unidirectional)."""
    for row in range(start, end):
        layout[h, row, start:(row + 1 if unidirectional else end)] = 1


def _sliding_window(layout: torch.Tensor, h: int, width: int, causal: bool = False) -> None:
    nb = layout.shape[1]
    if nb < width:
        raise ValueError(f"Number of sliding window blocks, {width}, must be smaller than overall number of "
                         f"blocks in a row, {nb}!")
    w = width // 2
    for row in range(nb):
        layout[h, row, max(0, row - w):(row + 1 if causal else min(row + w + 1, nb))] = 1


class DenseSparsityConfig(SparsityConfig):
    """Every block (not sparse; for comparison)."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        layout[:] = 1
        return layout


class FixedSparsityConfig(SparsityConfig):
    """The "fixed" pattern of Sparse Transformers (arXiv 1904.10509), as DeepSpeed customised it."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_local_blocks: int = 4, num_global_blocks: int = 1, attention: str = "bidirectional",
                 horizontal_global_attention: bool = False, num_different_global_patterns: int = 1) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        if num_local_blocks < 1 or num_global_blocks < 1 or num_local_blocks % num_global_blocks != 0:
            raise ValueError(f"Number of blocks in a local window, {num_local_blocks}, must be dividable by "
                             f"number of global blocks, {num_global_blocks}!")
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError('only "bi-directional" attentions can support horizontal global attention!')
        self.horizontal_global_attention = horizontal_global_attention
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError("Number of different layouts cannot be more than one when you have set a single "
                             "layout for all heads! Set different_layout_per_head to True.")
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ValueError(f"num_different_global_patterns, {num_different_global_patterns}, cannot be larger "
                             f"than num_local_blocks / num_global_blocks = {num_local_blocks // num_global_blocks}!")
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        nb = layout.shape[1]
        for i in range(0, nb, self.num_local_blocks):
            _local_windows(layout, h, i, min(i + self.num_local_blocks, nb), self.attention == "unidirectional")
        return layout

    def _global(self, h: int, layout: torch.Tensor, start: int, end: int) -> None:
        # DeepSpeed's quirk kept: unidirectional global columns start at row ``start``, so with
        # num_global_blocks > 1 a global block also sees the later blocks of its own group.
        layout[h, (0 if self.attention == "bidirectional" else start):, start:end] = 1
        if self.horizontal_global_attention:
            layout[h, start:end, :] = 1

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """The last ``num_global_blocks`` of each window are global; head ``h`` takes pattern
        ``h % num_different_global_patterns`` (1: the last blocks, 2: the ones before, ...)."""
        nb = layout.shape[1]
        first = self.num_local_blocks - (1 + h % self.num_different_global_patterns) * self.num_global_blocks
        full = nb - (nb % self.num_local_blocks)  # end of the last whole window
        for i in range(first, full, self.num_local_blocks):
            self._global(h, layout, i, i + self.num_global_blocks)
        if full < nb:  # a short last window: its global blocks are clamped to fit
            start = min(full + first, nb - self.num_global_blocks)
            self._global(h, layout, start, start + self.num_global_blocks)
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class VariableSparsityConfig(SparsityConfig, _Random):
    """Random blocks, local windows of the listed sizes (the last size repeats), global blocks by index."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 0, local_window_blocks: Sequence[int] = (4,),
                 global_block_indices: Sequence[int] = (0,), global_block_end_indices: Sequence[int] | None = None,
                 attention: str = "bidirectional", horizontal_global_attention: bool = False, *,
                 seed: int | None = None) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        if not local_window_blocks or any(b < 1 for b in local_window_blocks):
            raise ValueError(f"local_window_blocks must be a non-empty list of positive sizes, got "
                             f"{list(local_window_blocks)}")
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = list(local_window_blocks)
        self.global_block_indices = list(global_block_indices)
        _check_global_ranges(global_block_indices, global_block_end_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError('only "bi-directional" attentions can support horizontal global attention!')
        self.horizontal_global_attention = horizontal_global_attention
        self.seed = seed

    def set_random_layout(self, h: int, layout: torch.Tensor, rng: Any = random) -> torch.Tensor:
        """``num_random_blocks`` columns per row, drawn from all blocks (DeepSpeed's rule, also when
        unidirectional)."""
        nb = layout.shape[1]
        if nb < self.num_random_blocks:
            raise ValueError(f"Number of random blocks, {self.num_random_blocks}, must be smaller than overall "
                             f"number of blocks in a row, {nb}!")
        for row in range(nb):
            layout[h, row, rng.sample(range(nb), self.num_random_blocks)] = 1
        return layout

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        nb = layout.shape[1]
        uni = self.attention == "unidirectional"
        start = 0
        for size in self.local_window_blocks:
            _local_windows(layout, h, start, min(start + size, nb), uni)
            start += size
        last = self.local_window_blocks[-1]
        for i in range(start, nb, last):
            _local_windows(layout, h, i, min(i + last, nb), uni)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        nb = layout.shape[1]
        ends = self.global_block_end_indices or [s + 1 for s in self.global_block_indices]
        for start, end in zip(self.global_block_indices, ends):
            if start >= nb:
                continue
            end = min(end, nb)
            if self.horizontal_global_attention:
                layout[h, start:end, :] = 1
            layout[h, (0 if self.attention == "bidirectional" else start):, start:end] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        rng = self._rng()
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout, rng)
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class BigBirdSparsityConfig(SparsityConfig, _Random):
    """BigBird (arXiv 2007.14062): random blocks, a sliding window, and global first blocks."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 1, num_sliding_window_blocks: int = 3, num_global_blocks: int = 1,
                 attention: str = "bidirectional", *, seed: int | None = None) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = _check_attention(attention)
        self.seed = seed

    def set_random_layout(self, h: int, layout: torch.Tensor, rng: Any = random) -> torch.Tensor:
        """Random columns per row; unidirectional rows draw only from blocks ``<= row`` (so a row with
        fewer earlier blocks than ``num_random_blocks`` raises, as in DeepSpeed)."""
        nb = layout.shape[1]
        if nb < self.num_random_blocks:
            raise ValueError(f"Number of random blocks, {self.num_random_blocks}, must be smaller than overall "
                             f"number of blocks in a row, {nb}!")
        for row in range(nb):
            population = range(nb) if self.attention == "bidirectional" else range(row + 1)
            layout[h, row, rng.sample(population, self.num_random_blocks)] = 1
        return layout

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(layout, h, self.num_sliding_window_blocks)
        return layout

    def set_global_layout_itc(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        nb = layout.shape[1]
        if nb < self.num_global_blocks:
            raise ValueError(f"Number of global blocks, {self.num_global_blocks}, must be smaller than overall "
                             f"number of blocks in a row, {nb}!")
        layout[h, :self.num_global_blocks, :] = 1
        layout[h, :, :self.num_global_blocks] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        rng = self._rng()
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout, rng)
            self.set_sliding_window_layout(h, layout)
            self.set_global_layout_itc(h, layout)
        if self.attention == "unidirectional":
            layout = torch.tril(layout)  # nothing attends to a later block
        return self.check_and_propagate_first_head_layout(layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (arXiv 2004.05150): a sliding window plus global rows and columns."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_sliding_window_blocks: int = 3, global_block_indices: Sequence[int] = (0,),
                 global_block_end_indices: Sequence[int] | None = None, attention: str = "bidirectional") -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = list(global_block_indices)
        self.attention = _check_attention(attention)
        _check_global_ranges(global_block_indices, global_block_end_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(layout, h, self.num_sliding_window_blocks)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        nb = layout.shape[1]
        ends = self.global_block_end_indices or [s + 1 for s in self.global_block_indices]
        for start, end in zip(self.global_block_indices, ends):
            if start < nb:
                layout[h, start:min(end, nb), :] = 1
                layout[h, :, start:min(end, nb)] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
            self.set_global_layout(h, layout)
        if self.attention == "unidirectional":
            layout = torch.tril(layout)
        return self.check_and_propagate_first_head_layout(layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A sliding window only; ``unidirectional`` (the default) keeps the window's earlier half."""

    def __init__(self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3,
                 attention: str = "unidirectional") -> None:
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = _check_attention(attention)

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(layout, h, self.num_sliding_window_blocks, causal=self.attention != "bidirectional")
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)
