"""Block-sparse attention (DeepSpeed's ``deepspeed.ops.sparse_attention``, in plain PyTorch).

``layouts`` builds DeepSpeed's sparsity patterns, ``block_sparse`` computes attention over only the listed
blocks, ``modules`` holds ``SparseSelfAttention`` / ``BertSparseSelfAttention``, ``utils`` the BERT/RoBERTa
helpers and ``from_config`` the bridge from the ``sparse_attention`` config section.
"""

from .block_sparse import BlockTable, block_sparse_attention, dense_reference
from .from_config import sparsity_config_from_section
from .layouts import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)
from .modules import BertSparseSelfAttention, HFBertSparseSelfAttention, SparseSelfAttention
from .utils import SparseAttentionUtils

__all__ = [
    "SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig", "BigBirdSparsityConfig",
    "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig", "SparseSelfAttention",
    "BertSparseSelfAttention", "HFBertSparseSelfAttention", "SparseAttentionUtils", "BlockTable",
    "block_sparse_attention", "dense_reference", "sparsity_config_from_section",
]
