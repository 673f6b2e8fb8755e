"""The engine's data-efficiency state: what it adds to the model's forward and advances each step.

* legacy ``curriculum_learning``: each training forward at ``global_steps = g`` updates the difficulty for
  step ``g + 1`` and, with ``curriculum_type: "seqlen"``, passes ``curriculum_seqlen=<difficulty>``;
* ``progressive_layer_drop``: each training forward gets ``progressive_layer_drop=True, pld_theta=...``;
  the theta is advanced at each optimizer-step boundary with the step count before it increments;
* random-LTD: each training forward updates the kept-token count for ``global_steps``.

All of it is DeepSpeed's order (``engine._forward_prologue`` and ``engine.step`` of v0.19.5). The
schedulers' states go into checkpoints (``state_dict``), so a resumed run continues the schedules.
"""

from __future__ import annotations

import logging
from typing import Any

from ..config.data_efficiency import DataEfficiencyConfig, LegacyCurriculumConfig, ProgressiveLayerDropConfig
from .curriculum_scheduler import CurriculumScheduler
from .progressive_layer_drop import ProgressiveLayerDrop
from .random_ltd_scheduler import RandomLTDScheduler

_log = logging.getLogger("zerospeed.data_pipeline")


class DataEfficiency:
    """Built by ``runtime/build.py`` from the three sections; ``None`` members are off."""

    def __init__(self, legacy: LegacyCurriculumConfig, pld: ProgressiveLayerDropConfig,
                 data_efficiency: DataEfficiencyConfig, global_batch_size: int) -> None:
        self.legacy_config = legacy
        self.curriculum_scheduler_legacy = CurriculumScheduler(legacy) if legacy.enabled else None
        self.progressive_layer_drop = ProgressiveLayerDrop(pld.theta, pld.gamma) if pld.enabled else None
        ltd = data_efficiency.data_routing.random_ltd
        self.random_ltd_config = ltd
        self.random_ltd_scheduler = RandomLTDScheduler(ltd, global_batch_size) if ltd.enabled else None
        _warn_outer_flags(data_efficiency)

    @property
    def active(self) -> bool:
        return any(x is not None for x in (self.curriculum_scheduler_legacy, self.progressive_layer_drop,
                                            self.random_ltd_scheduler))

    def forward_kwargs(self, training: bool, global_steps: int) -> dict[str, Any]:
        """Advance the per-forward schedules and return the keyword arguments for the model's forward."""
        if not training:
            return {}
        kwargs: dict[str, Any] = {}
        if self.progressive_layer_drop is not None:
            kwargs.update(self.progressive_layer_drop.get_state())
        if self.curriculum_scheduler_legacy is not None:
            self.curriculum_scheduler_legacy.update_difficulty(global_steps + 1)
            if self.legacy_config.curriculum_type == "seqlen":
                kwargs["curriculum_seqlen"] = self.curriculum_scheduler_legacy.get_current_difficulty()
        if self.random_ltd_scheduler is not None:
            self.random_ltd_scheduler.update_seq(global_steps)
        return kwargs

    def on_step_boundary(self, global_steps: int) -> None:
        """At an optimizer-step boundary, before ``global_steps`` increments."""
        if self.progressive_layer_drop is not None:
            self.progressive_layer_drop.update_state(global_steps)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.curriculum_scheduler_legacy is not None:
            out["curriculum_learning"] = self.curriculum_scheduler_legacy.state_dict()
        if self.progressive_layer_drop is not None:
            out["progressive_layer_drop"] = self.progressive_layer_drop.state_dict()
        if self.random_ltd_scheduler is not None:
            out["random_ltd"] = self.random_ltd_scheduler.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, obj in (("curriculum_learning", self.curriculum_scheduler_legacy),
                         ("progressive_layer_drop", self.progressive_layer_drop),
                         ("random_ltd", self.random_ltd_scheduler)):
            if obj is not None and key in state:
                obj.load_state_dict(state[key])


def _warn_outer_flags(cfg: DataEfficiencyConfig) -> None:
    """DeepSpeed switches the features on by their own ``enabled`` only; say so when an outer flag is off."""
    on = {"data_efficiency.data_sampling.curriculum_learning": cfg.data_sampling.curriculum_learning.enabled,
          "data_efficiency.data_routing.random_ltd": cfg.data_routing.random_ltd.enabled}
    outer = {"data_efficiency.data_sampling.curriculum_learning": [("data_efficiency", cfg.enabled),
                                                                  ("data_efficiency.data_sampling",
                                                                   cfg.data_sampling.enabled)],
             "data_efficiency.data_routing.random_ltd": [("data_efficiency", cfg.enabled),
                                                         ("data_efficiency.data_routing", cfg.data_routing.enabled)]}
    for feature, enabled in on.items():
        for name, flag in outer[feature]:
            if enabled and not flag:
                _log.warning("%s is enabled while %s.enabled is false: as in DeepSpeed, the feature's own "
                             "'enabled' switches it on", feature, name)
