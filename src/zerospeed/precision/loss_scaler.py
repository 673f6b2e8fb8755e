"""Loss scaling for fp16, with DeepSpeed's semantics (one implementation for every ZeRO stage).

Dynamic: start at 2**initial_scale_power. An overflow (inf/nan in any rank's gradients) skips the
step on all ranks; with hysteresis h, the first h-1 consecutive overflows only use up hysteresis and
the h-th halves the scale (never below min_loss_scale). An overflow that would cut the scale while it
already sits at min_loss_scale raises :class:`LossScaleAtMinimumError` (DeepSpeed's default,
``raise_error_at_min_scale``), instead of skipping every later step in silence. The scale doubles after
``loss_scale_window`` clean steps *following* the last overflow, i.e. on the step where
``cur_iter - last_overflow_iter - 1`` is a positive multiple of the window (DeepSpeed >= 0.18); the
hysteresis is then restored (with consecutive_hysteresis it is restored after every clean step).
Static: a fixed scale, overflowing steps are still skipped.
"""

from __future__ import annotations

from typing import Any


class LossScaleAtMinimumError(RuntimeError):
    """fp16 gradients still overflow with the loss scale at ``fp16.min_loss_scale``: training cannot go on."""


class LossScaler:
    def __init__(self, scale: float, dynamic: bool, window: int = 1000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_scale: float = 1.0, factor: float = 2.0,
                 raise_error_at_min_scale: bool = True) -> None:
        self.cur_scale = float(scale)
        self.dynamic = dynamic
        self.window = window
        self.delayed_shift = hysteresis
        self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.factor = factor
        # DeepSpeed's DynamicLossScaler attribute: users turn the error off by setting it to False
        # (``engine.optimizer.loss_scaler.raise_error_at_min_scale = False``) or with the fp16 key.
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @classmethod
    def from_config(cls, fp16: Any) -> LossScaler:
        """Build from an ``Fp16Config`` (loss_scale 0 = dynamic)."""
        if fp16.loss_scale and fp16.loss_scale > 0:
            return cls(fp16.loss_scale, dynamic=False)
        return cls(2.0 ** fp16.initial_scale_power, dynamic=True, window=fp16.loss_scale_window,
                   hysteresis=fp16.hysteresis, consecutive_hysteresis=fp16.consecutive_hysteresis,
                   min_scale=fp16.min_loss_scale, raise_error_at_min_scale=fp16.raise_error_at_min_scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(
                        f"fp16 gradients overflowed (inf/nan) with the loss scale already at its minimum "
                        f"(fp16.min_loss_scale = {self.min_scale:g}), after {self.cur_iter} steps: every later "
                        "step would be skipped. The model diverged or its values exceed fp16's range: lower the "
                        "learning rate, enable gradient_clipping, or use bf16. Set "
                        "fp16.raise_error_at_min_scale: false (DeepSpeed: loss_scaler.raise_error_at_min_scale "
                        "= False) to keep skipping steps instead.")
                self.cur_scale = max(self.cur_scale / self.factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.cur_scale = float(sd["cur_scale"])
        self.cur_iter = int(sd["cur_iter"])
        self.last_overflow_iter = int(sd["last_overflow_iter"])
        self.cur_hysteresis = int(sd["cur_hysteresis"])


class NoScaler(LossScaler):
    """fp32/bf16: scale 1, never updates."""

    def __init__(self) -> None:
        super().__init__(1.0, dynamic=False)


class GradScalerRule(LossScaler):
    """``torch.amp.GradScaler``'s rule at its defaults (what DeepSpeed uses under fp16 ``torch_autocast``):
    start at 2**16; an overflow halves the scale (no hysteresis, no floor) and restarts the count; the 2000th
    consecutive clean step doubles it."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 2000) -> None:
        super().__init__(init_scale, dynamic=True, window=growth_interval, hysteresis=1, min_scale=0.0,
                         raise_error_at_min_scale=False)
        self.growth_tracker = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.cur_scale *= 0.5
            self.growth_tracker = 0
            self.last_overflow_iter = self.cur_iter
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.window:
                self.cur_scale *= 2.0
                self.growth_tracker = 0
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "growth_tracker": self.growth_tracker}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        self.growth_tracker = int(sd.get("growth_tracker", 0))
