"""A curriculum: the difficulty (sequence length, or any per-sample metric) to train at after ``step`` steps.

DeepSpeed's ``CurriculumScheduler``, same config dict, same numbers. With ``s = step / total_curriculum_step``:

* ``fixed_linear``: ``d = floor(s * (max - min) + min)``, rounded down to a multiple of ``difficulty_step``,
  raised to the first multiple of ``difficulty_step`` at or above ``min`` (DeepSpeed 0.19.8's floor), capped
  at ``max``;
* ``fixed_root``: the same with ``s ** (1 / root_degree)`` (degree 2: square root, grows fast early);
* ``fixed_discrete``: ``difficulty[i]`` for the first ``i`` with ``step <= max_step[i]``, the last
  difficulty after the last ``max_step``;
* ``custom``: the function given to ``set_custom_get_difficulty(fn)``, ``fn(step) -> difficulty``.

``update_difficulty(step)`` moves the current difficulty only while it is below ``max_difficulty``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from ..config.data_efficiency import (
    CurriculumMetricConfig,
    CurriculumScheduleConfig,
    CurriculumScheduleSection,
    LegacyCurriculumConfig,
)

_log = logging.getLogger("zerospeed.data_pipeline")


def _as_dict(config: Any) -> dict[str, Any]:
    """A validated copy of DeepSpeed's config dict (or of a config section)."""
    section: LegacyCurriculumConfig | CurriculumMetricConfig | CurriculumScheduleSection
    if isinstance(config, CurriculumScheduleSection):
        section = config
    else:
        keys = ("min_difficulty", "max_difficulty", "schedule_type", "schedule_config")
        for key in keys[:3]:
            if key not in config:
                raise ValueError(f"Curriculum learning requires the config '{key}'")
        section = CurriculumScheduleSection.parse_section({k: config[k] for k in keys if k in config}, "curriculum")
    sc: CurriculumScheduleConfig = section.schedule_config
    schedule = {"total_curriculum_step": sc.total_curriculum_step, "difficulty_step": sc.difficulty_step,
                "root_degree": sc.root_degree, "difficulty": sc.difficulty, "max_step": sc.max_step}
    return {"min_difficulty": section.min_difficulty, "max_difficulty": section.max_difficulty,
            "schedule_type": section.schedule_type,
            "schedule_config": {k: v for k, v in schedule.items() if v is not None}}


class CurriculumScheduler:
    """DeepSpeed's scheduler: ``state`` holds the config and ``current_difficulty`` (starts at min)."""

    def __init__(self, config: Any) -> None:
        cfg = _as_dict(config)
        self.state: dict[str, Any] = {
            "min_difficulty": cfg["min_difficulty"], "max_difficulty": cfg["max_difficulty"],
            "current_difficulty": cfg["min_difficulty"], "schedule_type": cfg["schedule_type"],
        }
        self.custom_get_difficulty: Callable[[int], Any] | None = None
        if cfg["schedule_type"] != "custom":
            self.state["schedule_config"] = cfg["schedule_config"]
        step = cfg["schedule_config"].get("difficulty_step")
        if cfg["schedule_type"] in ("fixed_linear", "fixed_root") and step % 8 != 0:
            _log.warning("When using seqlen metric, the difficulty_step for curriculum learning has to be multiple "
                         "of 8 (for FP16 data) or 16 (for INT8 data) to enable NVIDIA Tensor Core acceleration. "
                         "Disregard this warning if this is unrelated to your metric/hardware.")

    def get_current_difficulty(self) -> Any:
        return self.state["current_difficulty"]

    def set_current_difficulty(self, difficulty: Any) -> None:
        self.state["current_difficulty"] = difficulty

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], Any]) -> None:
        self.custom_get_difficulty = schedule_function

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {"current_difficulty": self.state["current_difficulty"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state["current_difficulty"] = state["current_difficulty"]

    def _fixed_discrete(self, global_steps: int) -> Any:
        sc = self.state["schedule_config"]
        for max_step, difficulty in zip(sc["max_step"], sc["difficulty"]):
            if global_steps <= max_step:
                return difficulty
        return sc["difficulty"][-1]

    def _fixed_root(self, global_steps: int, root_degree: float | None = None) -> Any:
        sc = self.state["schedule_config"]
        degree = sc["root_degree"] if root_degree is None else root_degree
        lo, hi, step = self.state["min_difficulty"], self.state["max_difficulty"], sc["difficulty_step"]
        frac = (float(global_steps) / sc["total_curriculum_step"]) ** (1.0 / degree)
        d = math.floor(frac * (hi - lo) + lo)
        d -= d % step
        d = max(d, -(-lo // step) * step)  # flooring can land below min (min 8, step 16 gives 0)
        return min(d, hi)

    def get_difficulty(self, global_steps: int) -> Any:
        kind = self.state["schedule_type"]
        if kind == "fixed_discrete":
            return self._fixed_discrete(global_steps)
        if kind == "fixed_linear":
            return self._fixed_root(global_steps, 1)
        if kind == "fixed_root":
            return self._fixed_root(global_steps)
        if self.custom_get_difficulty is None:
            raise RuntimeError("curriculum schedule_type 'custom' needs a schedule function: call "
                               "set_custom_get_difficulty(fn) (fn(global_steps) -> difficulty) before training")
        return self.custom_get_difficulty(global_steps)

    def update_difficulty(self, global_steps: int) -> Any:
        if self.state["current_difficulty"] < self.state["max_difficulty"]:
            self.state["current_difficulty"] = self.get_difficulty(global_steps)
        return self.state["current_difficulty"]
