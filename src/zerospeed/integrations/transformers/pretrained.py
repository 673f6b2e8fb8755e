"""``from_pretrained`` for ZeRO-3 without a full copy per rank: the model is built partitioned
(``zero.Init``) from its config and each rank reads only its own elements of the checkpoint's tensors
(``zero.stage3.pretrained``). Under stages 0-2 (or without ZeRO-3 in the config) it is a plain load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerospeed.config import load_config
from zerospeed.zero import Init
from zerospeed.zero.stage3.pretrained import LoadStats, load_pretrained_shards


def from_pretrained(model_class: Any, path: str | Path, zerospeed_config: Any, **config_kwargs: Any
                    ) -> tuple[Any, LoadStats]:
    """``(model, stats)``: ``model_class`` (a transformers model class) with the weights at ``path`` (a local
    directory with ``config.json`` and safetensors weights), partitioned when the config is ZeRO-3."""
    config = model_class.config_class.from_pretrained(str(path), **config_kwargs)
    cfg = load_config(zerospeed_config) if not hasattr(zerospeed_config, "zero_stage") else zerospeed_config
    with Init(config_dict_or_path=zerospeed_config, enabled=cfg.zero_stage == 3):
        model = model_class(config)
    stats = load_pretrained_shards(model, str(path))
    return model, stats
