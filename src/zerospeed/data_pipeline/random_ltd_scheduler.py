"""Random-LTD's token schedule: how many tokens the random-LTD layers keep after ``step`` steps.

DeepSpeed's ``RandomLTDScheduler``, same config and numbers (``fixed_linear``, the only type it has):
``n = floor(step / require_steps * (max_value - min_value) + min_value)``, rounded down to a multiple of
``seq_per_step``, capped at ``max_value``; it moves only while below ``max_value``. Each new step also adds
the layer-tokens it consumes to ``consumed_layer_tokens``:
``global_batch_size * (n * random_ltd_layer_num + max_value * (total_layer_num - random_ltd_layer_num))``.
"""

from __future__ import annotations

import math
from typing import Any

from ..config.data_efficiency import RandomLTDConfig, RandomLTDScheduleParams


class RandomLTDScheduler:
    """``state`` keys as DeepSpeed's: min_value, max_value, current_value, schedule_config, schedule_type,
    consumed_layer_tokens, current_steps; plus, between layers of one forward, ``sample_idx`` and
    ``attention_mask`` (the indices the first random-LTD layer drew, reused by the others)."""

    def __init__(self, config: RandomLTDConfig | dict[str, Any], global_batch_size: int) -> None:
        cfg = config if isinstance(config, RandomLTDConfig) else RandomLTDConfig.parse_section(
            {**config, "enabled": True}, "data_efficiency.data_routing.random_ltd")
        assert cfg.total_layer_num is not None and cfg.random_ltd_layer_num is not None
        assert cfg.random_ltd_schedule is not None
        self.model_layer_num = cfg.total_layer_num
        self.random_ltd_layer_num = cfg.random_ltd_layer_num
        self.config_schedule = cfg.random_ltd_schedule
        self.global_batch_size = global_batch_size
        self.state: dict[str, Any] = {}
        self.reset_to_init()

    def reset_to_init(self) -> None:
        sched = self.config_schedule
        params: RandomLTDScheduleParams = sched.schedule_config
        self.state.update(min_value=sched.min_value, max_value=sched.max_value, current_value=sched.min_value,
                          schedule_config={"require_steps": params.require_steps, "seq_per_step": params.seq_per_step},
                          schedule_type=sched.schedule_type, consumed_layer_tokens=0, current_steps=-1)

    def get_value(self, global_steps: int) -> int:
        sc = self.state["schedule_config"]
        lo, hi = self.state["min_value"], self.state["max_value"]
        n = math.floor(float(global_steps) / sc["require_steps"] * (hi - lo) + lo)
        n -= n % sc["seq_per_step"]
        return min(n, hi)

    def get_current_seq(self) -> int:
        return self.state["current_value"]

    def set_current_seq(self, seq_length: int) -> None:
        self.state["current_value"] = seq_length

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def update_seq(self, global_steps: int) -> None:
        if self.state["current_value"] < self.state["max_value"]:
            self.state["current_value"] = self.get_value(global_steps)
        if global_steps != self.state["current_steps"]:
            dropped_layers = self.model_layer_num - self.random_ltd_layer_num
            self.state["consumed_layer_tokens"] += self.global_batch_size * (
                self.state["current_value"] * self.random_ltd_layer_num + self.state["max_value"] * dropped_layers)
            self.state["current_steps"] = global_steps

    def get_total_layer_tokens(self, train_iters: int) -> int:
        for step in range(train_iters):
            self.update_seq(step)
        return self.state["consumed_layer_tokens"]

    _SAVED = ("consumed_layer_tokens", "current_steps", "current_value", "min_value", "max_value")

    def state_dict(self) -> dict[str, int]:
        return {k: self.state[k] for k in self._SAVED}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for k in self._SAVED:
            self.state[k] = state[k]
