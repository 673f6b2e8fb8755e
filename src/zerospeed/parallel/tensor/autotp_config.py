"""AutoTP's user rules: layer specs (regex -> row / column / skip), presets, and their merge.

A ``TPLayerSpec`` names parameters by regular expressions (``re.match`` against the parameter name, e.g.
``model.layers.0.self_attn.o_proj.weight``) and says how the owning layer is split:

    column   output dim split (weight rows), identity forward, all-reduce of the input gradient
    row      input dim split (weight columns), all-reduce of the output, bias added once after it
    skip     left whole on every rank (routers, low-rank projections)

Specs are tried in order and the first match wins (as in DeepSpeed 0.19.8's ``AutoTPConfig``). A preset
(``preset_model``) supplies specs for a model family; a user ``partition_config`` with
``use_default_specs: true`` puts its own specs before the preset's. The semantics, key names and defaults
follow ``deepspeed/module_inject/autotp_config.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

Shape = tuple[Any, ...]


class PartitionType(str, Enum):
    COLUMN = "column"
    ROW = "row"
    SKIP = "skip"


def _tuple_shape(shape: Any) -> Any:
    if isinstance(shape, (list, tuple)):
        return tuple(_tuple_shape(s) for s in shape)
    return shape


@dataclass
class TPLayerSpec:
    """One rule: parameters matching any of ``patterns`` are split as ``partition_type``.

    ``shape`` views the weight logically before splitting (``(3, -1)``: three equal packed sub-matrices,
    ``((q, k, v), -1)``: three unequal ones, one level of nesting at ``partition_dim`` only);
    ``partition_dim`` defaults to 0 for column and 1 for row. ``gather_output`` makes a column layer return
    the full output on every rank. ``model_types`` restricts the rule to those ``config.model_type``s.
    """

    patterns: list[str]
    partition_type: PartitionType = PartitionType.COLUMN
    shape: Shape | None = None
    partition_dim: int | None = None
    model_types: list[str] | None = None
    gather_output: bool = False
    grad_allreduce: bool = False

    def __post_init__(self) -> None:
        self.partition_type = PartitionType(str(getattr(self.partition_type, "value", self.partition_type)).lower())
        if isinstance(self.patterns, str):
            self.patterns = [self.patterns]
        if not self.patterns:
            raise ValueError("a TPLayerSpec needs at least one pattern")
        for p in self.patterns:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"AutoTP layer_specs pattern {p!r} is not a valid regular expression: {exc}") from None
        if self.shape is not None:
            self.shape = _tuple_shape(self.shape)
            self._check_shape()
        if self.gather_output and self.partition_type != PartitionType.COLUMN:
            raise ValueError(f"gather_output applies to column-parallel layers only (patterns {self.patterns})")
        if self.grad_allreduce and self.partition_type != PartitionType.SKIP:
            raise ValueError(f"grad_allreduce applies to skip (replicated) layers only (patterns {self.patterns})")

    def get_partition_dim(self) -> int:
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type == PartitionType.COLUMN else 1

    def _check_shape(self) -> None:
        assert self.shape is not None
        dim = self.get_partition_dim()
        if not 0 <= dim < len(self.shape):
            raise ValueError(f"AutoTP partition_dim {dim} is out of range for shape {self.shape}")
        for i, d in enumerate(self.shape):
            if isinstance(d, tuple):
                if i != dim:
                    raise ValueError(f"AutoTP shape {self.shape}: a nested tuple is allowed only at partition_dim {dim}")
                if not d or any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in d):
                    raise ValueError(f"AutoTP shape {self.shape}: sub-parameter sizes must be positive integers")
            elif not isinstance(d, int) or d == 0 or d < -1:
                raise ValueError(f"AutoTP shape {self.shape}: dimensions must be positive integers or -1")

    def sub_param_sizes(self) -> tuple[int, ...] | None:
        """Unequal packed sub-matrix sizes (``((q, k, v), -1)``), else None."""
        if self.shape is None:
            return None
        d = self.shape[self.get_partition_dim()]
        return d if isinstance(d, tuple) else None

    def num_sub_params(self) -> int | None:
        if self.shape is None:
            return None
        d = self.shape[self.get_partition_dim()]
        if isinstance(d, tuple):
            return len(d)
        return d if d > 0 else None

    def matches(self, param_name: str, model_type: str | None = None) -> bool:
        if self.model_types:
            if model_type is None or model_type.lower() not in {m.lower() for m in self.model_types}:
                return False
        return any(re.match(p, param_name) for p in self.patterns)


@dataclass
class AutoTPConfig:
    """Ordered layer specs plus DeepSpeed's flags (``strict_mode``: an unmatched 2-D layer is an error)."""

    tp_size: int = 1
    layer_specs: list[TPLayerSpec] = field(default_factory=list)
    embedding_partition_dim: int = 1
    lm_head_patterns: list[str] = field(default_factory=lambda: ["lm_head", "embed_out"])
    use_default_specs: bool = True
    strict_mode: bool = False

    def find_matching_spec(self, param_name: str, model_type: str | None = None) -> TPLayerSpec | None:
        """The first spec matching ``param_name`` (first match wins)."""
        for spec in self.layer_specs:
            if spec.matches(param_name, model_type):
                return spec
        return None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AutoTPConfig":
        known = {"tp_size", "layer_specs", "embedding_partition_dim", "lm_head_patterns", "use_default_specs",
                 "strict_mode"}
        extra = set(d) - known
        if extra:
            raise ValueError(f"tensor_parallel.partition_config: unknown keys {sorted(extra)} (known: {sorted(known)})")
        spec_keys = {"patterns", "partition_type", "shape", "partition_dim", "model_types", "gather_output",
                     "grad_allreduce"}
        specs = []
        for i, s in enumerate(d.get("layer_specs", [])):
            bad = set(s) - spec_keys
            if bad:
                raise ValueError(f"tensor_parallel.partition_config.layer_specs[{i}]: unknown keys {sorted(bad)} "
                                 f"(known: {sorted(spec_keys)})")
            if "patterns" not in s:
                raise ValueError(f"tensor_parallel.partition_config.layer_specs[{i}] needs 'patterns'")
            specs.append(TPLayerSpec(**s))
        return cls(tp_size=d.get("tp_size", 1), layer_specs=specs,
                   embedding_partition_dim=d.get("embedding_partition_dim", 1),
                   lm_head_patterns=list(d.get("lm_head_patterns", ["lm_head", "embed_out"])),
                   use_default_specs=d.get("use_default_specs", True), strict_mode=d.get("strict_mode", False))


def merge_autotp_configs(base: AutoTPConfig, override: AutoTPConfig) -> AutoTPConfig:
    """``override``'s specs first (they win), then ``base``'s."""
    return AutoTPConfig(tp_size=override.tp_size if override.tp_size > 1 else base.tp_size,
                        layer_specs=[*override.layer_specs, *base.layer_specs],
                        embedding_partition_dim=override.embedding_partition_dim,
                        lm_head_patterns=override.lm_head_patterns or base.lm_head_patterns,
                        use_default_specs=override.use_default_specs, strict_mode=override.strict_mode)


def _spec(kind: str, *patterns: str, **kw: Any) -> TPLayerSpec:
    return TPLayerSpec(patterns=list(patterns), partition_type=PartitionType(kind), **kw)


def _llama_like() -> list[TPLayerSpec]:
    return [_spec("row", r".*\.self_attn\.o_proj\.weight$"),
            _spec("column", r".*\.self_attn\.[qkv]_proj\.weight$"),
            _spec("row", r".*\.mlp\.down_proj\.weight$"),
            _spec("column", r".*\.mlp\.(up|gate)_proj\.weight$")]


PRESETS: dict[str, Any] = {
    "llama": _llama_like,
    "qwen2": _llama_like,
    "mistral": _llama_like,
    "bloom": lambda: [_spec("row", r".*\.self_attention\.dense\.weight$"),
                      _spec("column", r".*\.self_attention\.query_key_value\.weight$"),
                      _spec("row", r".*\.mlp\.dense_4h_to_h\.weight$"),
                      _spec("column", r".*\.mlp\.dense_h_to_4h\.weight$")],
    "chatglm": lambda: [_spec("row", r".*\.self_attention\.dense\.weight$"),
                        _spec("column", r".*\.self_attention\.query_key_value\.weight$", shape=(3, -1), partition_dim=0),
                        _spec("row", r".*\.mlp\.dense_4h_to_h\.weight$"),
                        _spec("column", r".*\.mlp\.dense_h_to_4h\.weight$", shape=(2, -1), partition_dim=0)],
    "mixtral": lambda: [_spec("row", r".*\.self_attn\.o_proj\.weight$"),
                        _spec("column", r".*\.self_attn\.[qkv]_proj\.weight$"),
                        _spec("row", r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$"),
                        _spec("column", r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$"),
                        _spec("skip", r".*\.block_sparse_moe\.gate\.weight$")],
    "deepseek_v2": lambda: [_spec("row", r".*\.self_attn\.o_proj\.weight$"),
                            _spec("skip", r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$"),
                            _spec("column", r".*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$"),
                            _spec("row", r".*\.mlp\.experts\.\d+\.down_proj\.weight$"),
                            _spec("column", r".*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$"),
                            _spec("skip", r".*\.mlp\.gate\.weight$"),
                            _spec("row", r".*\.mlp\.shared_experts\.down_proj\.weight$"),
                            _spec("column", r".*\.mlp\.shared_experts\.(up|gate)_proj\.weight$")],
    "phi3": lambda: [_spec("row", r".*\.self_attn\.o_proj\.weight$"),
                     _spec("column", r".*\.self_attn\.qkv_proj\.weight$", shape=(3, -1), partition_dim=0),
                     _spec("row", r".*\.mlp\.down_proj\.weight$"),
                     _spec("column", r".*\.mlp\.gate_up_proj\.weight$", shape=(2, -1), partition_dim=0)],
}
"""DeepSpeed 0.19.8's ``AutoTPPresets`` (``mistral`` is zerospeed's name for the Llama layout it shares)."""


def preset(name: str) -> AutoTPConfig:
    fn = PRESETS.get(name.lower())
    if fn is None:
        raise ValueError(f"tensor_parallel.preset_model {name!r} is unknown; presets: {sorted(PRESETS)}")
    return AutoTPConfig(layer_specs=fn())


def resolve_partition_config(preset_model: str | None, partition_config: dict[str, Any] | None,
                             tp_size: int) -> AutoTPConfig | None:
    """DeepSpeed's ``get_partition_config_object``: preset, then the user's specs (merged before the preset's
    when ``use_default_specs``, else replacing them); None when neither is given (the built-in rules apply)."""
    cfg = preset(preset_model) if preset_model else None
    if partition_config:
        custom = AutoTPConfig.from_dict(partition_config)
        cfg = merge_autotp_configs(cfg, custom) if cfg is not None and custom.use_default_specs else custom
    if cfg is not None:
        cfg.tp_size = tp_size
    return cfg
