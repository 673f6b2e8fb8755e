"""``dump_state``: DeepSpeed prints the engine's state at start-up on rank 0; this is what we print.

One ``name ........ value`` line per item, sorted, as DeepSpeed's ``print_configuration``: the resolved
batch sizes, stage, dtypes, world sizes, optimizer and scheduler, and every config key with its value.
"""

from __future__ import annotations

import json
from typing import Any


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def engine_state(engine: Any) -> str:
    """The engine's state as text (the caller prints it on rank 0)."""
    opt = engine.optimizer
    base = getattr(opt, "optimizer", None)
    items: dict[str, Any] = {
        "train_batch_size": engine.train_batch_size(),
        "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "zero_optimization_stage": engine.zero_optimization_stage(),
        "compute_dtype": str(engine.compute_dtype),
        "device": str(engine.device),
        "global_rank": engine.global_rank,
        "world_size": engine.world_size,
        "dp_world_size": engine.dp_world_size,
        "parameters": sum(p.numel() for p in engine.module.parameters()),
        "optimizer": type(base).__name__ if base is not None else None,
        "lr_scheduler": type(engine.lr_scheduler).__name__ if engine.lr_scheduler is not None else None,
    }
    config: dict[str, Any] = {}
    _flatten("", json.loads(engine.config.model_dump_json()), config)
    items.update({f"config.{k}": v for k, v in config.items()})
    width = max(len(k) for k in items) + 3
    lines = ["[zerospeed] engine state (dump_state):"]
    lines += [f"  {k} {'.' * (width - len(k))} {v}" for k, v in sorted(items.items())]
    return "\n".join(lines)
