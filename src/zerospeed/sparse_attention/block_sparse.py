"""Block-sparse attention in plain PyTorch: only the blocks a layout lists are ever computed or stored.

The layout's non-zero blocks are listed once (``BlockTable``), head-major and row by row:
``block i = (head[i], row[i], col[i])``. For a batch, with ``b`` = block size and ``D`` = head size::

    q_i = scale * Q[:, head_i, rows of block row_i]  (B, nnz, b, D)   gathered (scaled) queries
    k_i, v_i = K, V[:, head_i, keys of block col_i]   (B, nnz, b, D)   gathered keys, values
    s_i = q_i @ k_i^T  (+ rpe, + masks)               (B, nnz, b, b)   scores of the listed blocks only
    softmax over all blocks of the same (head, row):  max and sum reduced per row segment
    out[head, row] = sum_i softmax(s_i) @ v_i         (index_add over the blocks of each row)

Every intermediate is O(nnz · b · max(b, D)), never O(seq²); autograd differentiates it as written (the
row maximum is a constant shift, taken without gradient). A query row with
nothing to attend to (no block, or every key masked with -inf) gives NaN, as dense softmax attention does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class BlockTable:
    """The non-zero blocks of a ``(heads, nb, nb)`` layout, as index vectors of length ``nnz``."""

    heads: int
    num_blocks: int
    block: int
    head: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    row_segment: torch.Tensor  # head * nb + row: which output row block each block adds into
    key_segment: torch.Tensor  # head * nb + col: which key/value block it reads

    @classmethod
    def from_layout(cls, layout: torch.Tensor, block: int, device: torch.device | None = None) -> BlockTable:
        if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
            raise ValueError(f"a layout is (heads, blocks, blocks); got shape {tuple(layout.shape)}")
        heads, nb = int(layout.shape[0]), int(layout.shape[1])
        h, r, c = (t.to(device) for t in layout.nonzero(as_tuple=True))
        return cls(heads, nb, block, h, r, c, h * nb + r, h * nb + c)

    @property
    def nnz(self) -> int:
        return int(self.head.numel())

    def chunks(self, max_blocks: int) -> list[tuple[BlockTable, int, int]]:
        """Consecutive whole rows, at most ``max_blocks`` blocks each (a longer row alone):
        ``(sub-table, first row segment, row segments)``; together they cover every row segment once."""
        if max_blocks < 1:
            raise ValueError(f"chunk_blocks must be positive, got {max_blocks}")
        segments = self.heads * self.num_blocks
        counts = torch.bincount(self.row_segment.cpu(), minlength=segments).tolist()
        out: list[tuple[BlockTable, int, int]] = []
        first = start = blocks = 0
        for seg, n in enumerate(counts):
            if blocks and blocks + n > max_blocks:
                out.append((self._slice(start, start + blocks), first, seg - first))
                first, start, blocks = seg, start + blocks, 0
            blocks += n
        out.append((self._slice(start, start + blocks), first, segments - first))
        return out

    def _slice(self, start: int, end: int) -> BlockTable:
        return BlockTable(self.heads, self.num_blocks, self.block, self.head[start:end], self.row[start:end],
                          self.col[start:end], self.row_segment[start:end], self.key_segment[start:end])


def _blocks_of_square(x: torch.Tensor, table: BlockTable) -> torch.Tensor:
    """``x`` (Z, H or 1, L, L) -> its listed blocks (Z, nnz, b, b)."""
    z, hx = x.shape[0], x.shape[1]
    nb, b = table.num_blocks, table.block
    tiles = x.reshape(z, hx, nb, b, nb, b).permute(0, 1, 2, 4, 3, 5)  # (Z, H, nb, nb, b, b), a view
    head = table.head if hx > 1 else torch.zeros_like(table.head)
    return tiles[:, head, table.row, table.col]


def _as_4d(mask: torch.Tensor, what: str, seq: int) -> torch.Tensor:
    """(L, L), (Z, L, L) or (Z, H, L, L) -> (Z, H or 1, L, L)."""
    if mask.shape[-2:] != (seq, seq):
        raise ValueError(f"{what} must end in ({seq}, {seq}); got shape {tuple(mask.shape)}")
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask


def block_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, table: BlockTable,
                           scale: float, rpe: torch.Tensor | None = None,
                           key_padding_mask: torch.Tensor | None = None,
                           attn_mask: torch.Tensor | None = None, chunk_blocks: int | None = None) -> torch.Tensor:
    """Attention of ``(B, H, L, D)`` tensors over the blocks of ``table``.

    Masks are additive here (0 keeps, -inf or a large negative drops): ``key_padding_mask`` (B, L) is added
    to every query row; ``attn_mask`` (L, L) or (B|1, H|1, L, L) and ``rpe`` (B|1, H|1, L, L) are added
    entry by entry. The scores are ``scale * q·k`` plus these, in that order (DeepSpeed's).

    ``chunk_blocks``: compute whole rows at most this many blocks at a time, each chunk under activation
    checkpointing, so that only one chunk's blocks are alive at once (forward and backward); memory is then
    O(chunk) plus the inputs, for about one more forward pass of work. ``None``: all blocks at once.
    """
    bsz, heads, seq, dim = query.shape
    b, nb = table.block, table.num_blocks
    if heads != table.heads or seq != nb * b:
        raise ValueError(f"query of shape {tuple(query.shape)} does not match the layout: {table.heads} heads, "
                         f"{nb} blocks of {b} tokens")
    if key_padding_mask is not None and key_padding_mask.shape != (bsz, seq):
        raise ValueError(f"key_padding_mask must be (batch, seq) = ({bsz}, {seq}); got {tuple(key_padding_mask.shape)}")
    rpe = None if rpe is None else _as_4d(rpe, "rpe", seq)
    attn_mask = None if attn_mask is None else _as_4d(attn_mask, "attn_mask", seq)
    if scale != 1.0:  # scaling the queries (seq entries) rather than the scores (nnz * b * b entries)
        query = query * scale
    segments = heads * nb
    if chunk_blocks is None or table.nnz <= chunk_blocks:
        out = _attend(query, key, value, table, 0, segments, rpe, key_padding_mask, attn_mask)
    else:
        parts = []
        for sub, first, count in table.chunks(chunk_blocks):
            args = (query, key, value, sub, first, count, rpe, key_padding_mask, attn_mask)
            parts.append(checkpoint(_attend, *args, use_reentrant=False) if torch.is_grad_enabled()
                         else _attend(*args))
        out = torch.cat(parts, dim=1)
    return out.to(query.dtype).reshape(bsz, heads, seq, dim)


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, table: BlockTable, first: int, count: int,
            rpe: torch.Tensor | None, key_padding_mask: torch.Tensor | None,
            attn_mask: torch.Tensor | None) -> torch.Tensor:
    """The output rows ``[first, first + count)`` (as head * nb + row) from ``table``'s blocks, which are
    exactly those rows' blocks: (B, count, b, D)."""
    bsz, heads, seq, dim = query.shape
    b, nb = table.block, table.num_blocks
    # index_select, not x[:, idx]: its backward is an index_add, much faster on CPU than index_put
    q = torch.index_select(query.reshape(bsz, heads * nb, b, dim), 1, table.row_segment)
    k = torch.index_select(key.reshape(bsz, heads * nb, b, dim), 1, table.key_segment)
    v = torch.index_select(value.reshape(bsz, heads * nb, b, dim), 1, table.key_segment)
    # fp16/bf16 inputs: the softmax runs in fp32 (as DeepSpeed's kernel does), the matmuls in the input dtype
    acc = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    scores = torch.matmul(q, k.transpose(-1, -2)).to(acc)  # (B, nnz, b, b)
    if rpe is not None:
        scores = scores + _blocks_of_square(rpe, table)
    if key_padding_mask is not None:
        kp = key_padding_mask.to(scores.dtype).reshape(bsz, nb, b)[:, table.col]  # (B, nnz, b)
        scores = scores + kp.unsqueeze(-2)
    if attn_mask is not None:
        scores = scores + _blocks_of_square(attn_mask, table).to(scores.dtype)

    # Softmax over each (head, row) segment: subtract the segment's max (no gradient needed: a constant
    # shift of a softmax's inputs changes nothing), exponentiate, normalise by the segment's sum.
    rows = table.row_segment - first
    with torch.no_grad():
        block_max = scores.amax(dim=-1)  # (B, nnz, b)
        row_max = torch.full((bsz, count, b), float("-inf"), dtype=scores.dtype, device=scores.device)
        row_max.scatter_reduce_(1, rows.view(1, -1, 1).expand_as(block_max), block_max, "amax")
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max[:, rows].unsqueeze(-1))
    denom = weights.new_zeros(bsz, count, b).index_add(1, rows, weights.sum(dim=-1))
    context = torch.matmul(weights.to(v.dtype), v).to(acc)  # (B, nnz, b, D), not yet normalised
    out = context.new_zeros(bsz, count, b, dim).index_add(1, rows, context)
    return out / denom.unsqueeze(-1)


def dense_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: torch.Tensor, block: int,
                    scale: float, rpe: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None,
                    attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The same attention computed densely (O(seq²)): for tests and for checking a layout."""
    seq = query.shape[-2]
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if rpe is not None:
        scores = scores + rpe
    if key_padding_mask is not None:
        scores = scores + key_padding_mask.to(scores.dtype)[:, None, None, :]
    if attn_mask is not None:
        scores = scores + attn_mask.to(scores.dtype)
    keep = layout.to(torch.bool).repeat_interleave(block, 1).repeat_interleave(block, 2)[:, :seq, :seq]
    scores = scores.masked_fill(~keep.to(scores.device), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), value)
