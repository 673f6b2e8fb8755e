"""When each technique acts: DeepSpeed 0.19.6's ``compression_scheduler``.

The engine steps it after every applied optimizer step (and once before the first forward, at step 0).
From ``schedule_offset`` on, a technique's ``*_enabled`` flag is switched on in each of its groups' modules
and stays on (sparse pruning with ``snip_momentum`` has a window ending at ``schedule_offset_end``; that
method is not supported yet). ``weight_quantization_enabled`` tells MoQ whether to advance its bits.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from ..compat.compression_helper import recursive_getattr
from ..config.compression_training import TECHNIQUES, CompressionTrainingConfig
from .groups import MatchedGroup, match_groups

_log = logging.getLogger("zerospeed.compression")


class CompressionScheduler:
    """Switches techniques on by step count (one instance per engine; no global state)."""

    def __init__(self, model: nn.Module, compression_config: CompressionTrainingConfig | dict[str, Any]) -> None:
        if isinstance(compression_config, dict):
            compression_config = CompressionTrainingConfig.parse_section(compression_config, "compression_training")
        self.model = model
        self.config = compression_config
        self.groups: list[MatchedGroup] = match_groups(model, compression_config, check_duplicates=False)
        self.training_steps = 0
        self.weight_quantization_enabled = False
        self.switched_on: dict[str, int] = {}  # technique -> the step it was switched on at

    def _offset(self, technique: str) -> int:
        return int(self.config.technique(technique).shared_parameters.schedule_offset)  # type: ignore[attr-defined]

    def check_all_modules(self) -> None:
        for technique in TECHNIQUES:
            if technique in self.switched_on or not self.config.technique(technique).shared_parameters.enabled:  # type: ignore[attr-defined]
                continue
            if self.training_steps < self._offset(technique):
                continue
            for group in self.groups:
                if group.technique == technique:
                    for name in group.all_modules():
                        setattr(recursive_getattr(self.model, name), f"{technique}_enabled", True)
            self.switched_on[technique] = self.training_steps
            if technique == "weight_quantization":
                self.weight_quantization_enabled = True
            _log.info("%s is enabled at step %d", technique.replace("_", " ").capitalize(), self.training_steps)

    def step(self, step_zero_check: bool = False) -> None:
        """Count one optimizer step (not for ``step_zero_check``: the check before the first forward)."""
        if not step_zero_check:
            self.training_steps += 1
        self.check_all_modules()

    def state_dict(self) -> dict[str, Any]:
        return {"training_steps": self.training_steps, "switched_on": dict(self.switched_on)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Back to a saved step: the techniques switched on by then are on, the others off again (a rollback
        in the same engine turns off what was switched on after it)."""
        self.training_steps = int(state["training_steps"])
        self.switched_on = {t: int(s) for t, s in state.get("switched_on", {}).items()}
        for group in self.groups:
            for name in group.all_modules():
                setattr(recursive_getattr(self.model, name), f"{group.technique}_enabled",
                        group.technique in self.switched_on)
        self.weight_quantization_enabled = "weight_quantization" in self.switched_on


compression_scheduler = CompressionScheduler  # DeepSpeed's name

__all__ = ["CompressionScheduler", "compression_scheduler"]
