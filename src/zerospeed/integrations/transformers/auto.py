"""Hugging Face's ``"auto"`` values in a DeepSpeed config, resolved from ``TrainingArguments`` as the HF Trainer
does for DeepSpeed: batch sizes, accumulation, clipping, optimizer and scheduler parameters, precision, and the
hidden-size based bucket sizes. A value that is set but contradicts the Trainer's argument is an error listing
every mismatch (as in Hugging Face); an ``"auto"`` nothing can fill is an error naming it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any


def load(config: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(config, (str, Path)):
        return json.loads(Path(config).read_text())
    return copy.deepcopy(dict(config))


class _Filler:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.mismatches: list[str] = []

    def _node(self, key: str) -> tuple[dict[str, Any] | None, str]:
        *parents, leaf = key.split(".")
        node: Any = self.config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, leaf
        return node, leaf

    def get(self, key: str) -> Any:
        node, leaf = self._node(key)
        return None if node is None else node.get(leaf)

    def fill(self, key: str, value: Any, hf_name: str | None = None, must_match: bool = True) -> None:
        node, leaf = self._node(key)
        if node is None:
            return
        if node.get(leaf) == "auto":
            node[leaf] = value
        elif must_match and hf_name and leaf in node and node[leaf] != value:
            self.mismatches.append(f"- config {key}={node[leaf]!r} vs TrainingArguments {hf_name}={value!r}")


def _hidden_size(model: Any) -> int | None:
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        if getattr(c, "hidden_size", None):
            return int(c.hidden_size)
        if getattr(c, "hidden_sizes", None):
            return int(max(c.hidden_sizes))
    return None


def resolve(config: dict[str, Any], args: Any, model: Any, num_training_steps: int) -> dict[str, Any]:
    """A copy of ``config`` with every ``"auto"`` filled from ``args`` (``TrainingArguments``) and ``model``."""
    cfg = copy.deepcopy(config)
    f = _Filler(cfg)
    micro, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    f.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    f.fill("gradient_accumulation_steps", gas, "gradient_accumulation_steps")
    f.fill("train_batch_size", args.world_size * micro * gas, "train_batch_size (world x micro x accumulation)")
    f.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    f.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    f.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    f.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    f.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    f.fill("scheduler.params.warmup_min_lr", 0, must_match=False)
    f.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    f.fill("scheduler.params.total_num_steps", num_training_steps, "max_steps (calculated)")
    f.fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)), "warmup_steps")
    f.fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16")
    f.fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16")
    hidden_keys = ["zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                   "zero_optimization.stage3_param_persistence_threshold"]
    if any(f.get(k) == "auto" for k in hidden_keys):
        hidden = _hidden_size(model)
        if hidden is None:
            raise ValueError(f"{[k for k in hidden_keys if f.get(k) == 'auto']} are 'auto' but the model's config has "
                             "no hidden_size: set them to numbers")
        f.fill("zero_optimization.reduce_bucket_size", hidden * hidden, must_match=False)
        f.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden), must_match=False)
        f.fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden, must_match=False)
    if f.mismatches:
        raise ValueError("the config contradicts TrainingArguments (set these to \"auto\" to take the Trainer's "
                         "values):\n" + "\n".join(f.mismatches))
    left = _autos(cfg)
    if left:
        raise ValueError(f"config values still 'auto' that nothing can fill: {left}")
    return cfg


def _autos(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [k for key, v in node.items() for k in _autos(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if node == "auto" else []
