"""Vocab-parallel embedding: each rank holds a slice of the vocabulary rows (DeepSpeed's ``VocabParallelEmbedding``).

A token outside this rank's rows ``[vocab_start_index, vocab_end_index)`` looks up row 0 and its result
is zeroed; the per-rank partial embeddings are then all-reduced, so every token gets exactly one
non-zero contribution. Under sequence parallelism the partials are reduce-scattered along ``seq_dim``
instead, so the embedding output already holds ``seq/tp`` tokens. When tied to a
:class:`~.column.VocabParallelLinear` lm head, the embedding uses that layer's (already cut) weight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .column import VocabParallelLinear
from .layer import TensorParallelLayer
from .mappings import reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region
from .partition import TPShardSpec
from .shard import AutoTPMeta, checked_shard_sizes


class VocabParallelEmbedding(TensorParallelLayer):
    """``VocabParallelEmbedding(module, mp_group=None, tied_vocab_parallel_linear=None, **kwargs)``.

    Keyword arguments: ``name``, ``tp_meta``, ``sequence_parallel``, ``seq_dim`` (default 1).
    """

    def __init__(self, module: nn.Embedding, mp_group: Any = None,
                 tied_vocab_parallel_linear: VocabParallelLinear | None = None, *, name: str | None = None,
                 tp_meta: AutoTPMeta | None = None, sequence_parallel: bool = False, seq_dim: int = 1) -> None:
        super().__init__(mp_group, name=name, tp_meta=tp_meta)
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise ValueError(f"layer '{self.label}': a vocab-parallel embedding with max_norm, scale_grad_by_freq "
                             "or sparse is not supported yet by zerospeed")
        self.sequence_parallel = sequence_parallel
        self.seq_dim = seq_dim
        vocab, dim = module.weight.shape
        if tied_vocab_parallel_linear is not None:
            lm = tied_vocab_parallel_linear
            if lm.transposed:
                raise ValueError(f"layer '{self.label}': tying to a Conv1D lm head is not supported yet by zerospeed")
            vocab, dim = lm.shard_specs()["weight"].full_shape  # module.weight may already be lm's (cut) weight
            if lm.mp_group is not mp_group or (module.weight is not lm.weight and module.weight.shape != (vocab, dim)):
                raise ValueError(f"layer '{self.label}': the tied lm head '{lm.label}' has another group or a "
                                 f"weight of shape {(vocab, dim)}, not {tuple(module.weight.shape)}")
            self.weight = lm.weight
            self.partition_sizes = lm.partition_sizes
            self._specs["weight"] = lm.shard_specs()["weight"]
        else:
            self.weight = module.weight
            self.partition_sizes = checked_shard_sizes(vocab, self.tp_world_size, self.label, "vocabulary rows",
                                                       self.tp_meta, self.name)
            self._keep_shard("weight", TPShardSpec((vocab, dim), 0, (self.partition_sizes,)))
        self.num_embeddings = vocab
        self.embedding_dim = dim
        self.vocab_start_index = sum(self.partition_sizes[: self.tp_index])
        self.vocab_end_index = self.vocab_start_index + self.partition_sizes[self.tp_index]
        pad = module.padding_idx
        self.padding_idx = pad - self.vocab_start_index if pad is not None and \
            self.vocab_start_index <= pad < self.vocab_end_index else None

    @property
    def vocab_size(self) -> int:
        return self.num_embeddings

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.tp_world_size == 1:
            return F.embedding(input, self.weight, padding_idx=self.padding_idx)
        outside = (input < self.vocab_start_index) | (input >= self.vocab_end_index)
        local = (input - self.vocab_start_index).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight, padding_idx=self.padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.mp_group, self.seq_dim)
        return reduce_from_tensor_model_parallel_region(partial, self.mp_group)
