"""Loss scaling for fp16, with DeepSpeed's semantics (one implementation for every ZeRO stage).

Dynamic: start at 2**initial_scale_power. An overflow (inf/nan in any rank's gradients) skips the
step on all ranks; with hysteresis h, the first h-1 consecutive overflows only use up hysteresis and
the h-th halves the scale (never below min_loss_scale). After ``loss_scale_window`` steps without
overflow the scale doubles (and hysteresis is restored; with consecutive_hysteresis it is restored
after every clean step). Static: a fixed scale, overflowing steps are still skipped.
"""

from __future__ import annotations

from typing import Any


class LossScaler:
    def __init__(self, scale: float, dynamic: bool, window: int = 1000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_scale: float = 1.0, factor: float = 2.0) -> None:
        self.cur_scale = float(scale)
        self.dynamic = dynamic
        self.window = window
        self.delayed_shift = hysteresis
        self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.factor = factor
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @classmethod
    def from_config(cls, fp16: Any) -> LossScaler:
        """Build from an ``Fp16Config`` (loss_scale 0 = dynamic)."""
        if fp16.loss_scale and fp16.loss_scale > 0:
            return cls(fp16.loss_scale, dynamic=False)
        return cls(2.0 ** fp16.initial_scale_power, dynamic=True, window=fp16.loss_scale_window,
                   hysteresis=fp16.hysteresis, consecutive_hysteresis=fp16.consecutive_hysteresis,
                   min_scale=fp16.min_loss_scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.window == 0:
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
