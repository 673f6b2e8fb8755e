"""The ``sparse_attention`` section (DeepSpeed's keys, per-mode defaults and parsing).

DeepSpeed reads the section into a dict (``DeepSpeedConfig.sparse_attention``) from which the model builds
its sparsity config; nothing in the engine uses it. Here it is ``engine.config.sparse_attention`` (``None``
when absent): ``.to_dict()`` is DeepSpeed's dict and ``.sparsity_config(num_heads)`` builds the layout
class (``zerospeed.sparse_attention``). Each mode reads the keys DeepSpeed reads for it; a key the mode
does not read is an error here (DeepSpeed drops it silently). One difference: ``attention`` is also read
for ``bigbird`` and ``bslongformer`` (DeepSpeed's parser drops it, though both classes take it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .base import Section
from .errors import ConfigError

Mode = Literal["dense", "fixed", "variable", "bigbird", "bslongformer"]

# The keys each mode reads (besides ``mode``), in DeepSpeed's order.
MODE_KEYS: dict[str, tuple[str, ...]] = {
    "dense": ("block",),
    "fixed": ("block", "different_layout_per_head", "num_local_blocks", "num_global_blocks", "attention",
              "horizontal_global_attention", "num_different_global_patterns"),
    "variable": ("block", "different_layout_per_head", "num_random_blocks", "local_window_blocks",
                 "global_block_indices", "global_block_end_indices", "attention", "horizontal_global_attention"),
    "bigbird": ("block", "different_layout_per_head", "num_random_blocks", "num_sliding_window_blocks",
                "num_global_blocks", "attention"),
    "bslongformer": ("block", "different_layout_per_head", "num_sliding_window_blocks", "global_block_indices",
                     "global_block_end_indices", "attention"),
}


class SparseAttentionConfig(Section):
    """DeepSpeed's ``sparse_attention`` keys and defaults (``num_random_blocks`` defaults to 0 for every
    mode, as DeepSpeed's parser has it, although ``BigBirdSparsityConfig``'s own default is 1)."""

    mode: Mode = "fixed"
    block: int = Field(16, ge=1)
    different_layout_per_head: bool = False
    num_local_blocks: int = Field(4, ge=1)
    num_global_blocks: int = Field(1, ge=1)
    attention: Literal["bidirectional", "unidirectional"] = "bidirectional"
    horizontal_global_attention: bool = False
    num_different_global_patterns: int = Field(1, ge=1)
    num_random_blocks: int = Field(0, ge=0)
    local_window_blocks: list[int] = [4]  # pydantic copies list defaults
    global_block_indices: list[int] = [0]
    global_block_end_indices: list[int] | None = None
    num_sliding_window_blocks: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _keys_of_mode(self) -> SparseAttentionConfig:
        read = set(MODE_KEYS[self.mode]) | {"mode"}
        for key in sorted(self.model_fields_set - read):
            raise ConfigError(f"sparse_attention.{key}", f"mode {self.mode!r} does not use this key (DeepSpeed "
                                                         f"ignores it); its keys are {', '.join(MODE_KEYS[self.mode])}")
        return self

    def to_dict(self) -> dict[str, Any]:
        """DeepSpeed's ``DeepSpeedConfig.sparse_attention``: ``mode`` and the keys the mode reads."""
        values = SparseAttentionConfig.model_dump(self)  # every key goes on to the layout class
        return {"mode": self.mode, **{k: values[k] for k in MODE_KEYS[self.mode]}}

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_dict().get(key, default)

    def sparsity_config(self, num_heads: int) -> Any:
        """The ``SparsityConfig`` this section describes, for a layer with ``num_heads`` heads."""
        from ..sparse_attention import sparsity_config_from_section

        return sparsity_config_from_section(self, num_heads)
