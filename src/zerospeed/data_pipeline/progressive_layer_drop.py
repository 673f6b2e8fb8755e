"""Progressive layer drop (PLD, https://arxiv.org/abs/2010.13369): the keep probability of a layer falls
from 1 towards ``theta`` as training proceeds, ``theta(t) = (1 - theta) * exp(-gamma * t) + theta``.

The engine passes ``progressive_layer_drop=True, pld_theta=<theta(t)>`` to the model's forward in training;
the model decides which layers to skip (``zerospeed.models.gpt`` does stochastic depth with it). As in
DeepSpeed, ``update_state(global_steps)`` runs at each optimizer-step boundary before the step counter
advances, so the forward of step ``g >= 1`` sees ``theta(g - 1)`` and the first two see 1.0.
"""

from __future__ import annotations

import math
from typing import Any


def pld_keep_probability(step: int, theta: float, gamma: float) -> float:
    """``(1 - theta) * exp(-gamma * step) + theta``."""
    return (1.0 - theta) * math.exp(-gamma * step) + theta


class ProgressiveLayerDrop:
    """DeepSpeed's ``ProgressiveLayerDrop(theta, gamma)``; ``current_theta`` starts at 1.0."""

    def __init__(self, theta: float = 0.5, gamma: float = 0.001) -> None:
        self.theta = theta
        self.gamma = gamma
        self.current_theta = 1.0

    def get_state(self) -> dict[str, Any]:
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        self.current_theta = pld_keep_probability(global_step, self.theta, self.gamma)

    def state_dict(self) -> dict[str, float]:
        return {"current_theta": self.current_theta}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.current_theta = float(state["current_theta"])
