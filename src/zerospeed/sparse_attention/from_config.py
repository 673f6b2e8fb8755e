"""The ``sparse_attention`` config section -> the ``SparsityConfig`` of a layer (DeepSpeed's mode table)."""

from __future__ import annotations

from typing import Any

from .layouts import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

MODE_CLASSES: dict[str, type[SparsityConfig]] = {
    "dense": DenseSparsityConfig,
    "fixed": FixedSparsityConfig,
    "variable": VariableSparsityConfig,
    "bigbird": BigBirdSparsityConfig,
    "bslongformer": BSLongformerSparsityConfig,
}


def sparsity_config_from_section(section: Any, num_heads: int) -> SparsityConfig:
    """``section``: a ``SparseAttentionConfig`` or DeepSpeed's dict (``{"mode": ..., <the mode's keys>}``)."""
    params = dict(section.to_dict() if hasattr(section, "to_dict") else section)
    mode = params.pop("mode", "fixed")
    if mode not in MODE_CLASSES:
        raise NotImplementedError(f"Given sparsity mode, {mode}, has not been implemented yet! "
                                  f"(modes: {', '.join(MODE_CLASSES)})")
    return MODE_CLASSES[mode](num_heads=num_heads, **params)
