"""MoQ, mixture-of-quantization (DeepSpeed 0.19.6's ``runtime/quantize.py``): the bits of each quantized weight
fall over training.

Each call of ``quantize`` (once before the first forward if the technique is on at step 0, then after every
optimizer step while it is on) counts one step ``n``; with ``fp16_mixed_quantize`` the shared mixing ratio
``r`` falls by ``quantize_change_ratio`` (it starts at 1). Then for each weight, in model order: if its bits are
above the target and ``n >= period``, the bits fall by one, ``period`` doubles (times the block's eigenvalue
factor ``1 + floor(4 e)``, ``e`` in [0, 1]) and ``r`` goes back to 1. The forward then uses
``r w + (1 - r) Q_bits(w)`` (``weight_quant.py``). A skipped (overflowed) step counts nothing, unless
eigenvalues are on (as in DeepSpeed).
"""

from __future__ import annotations

import logging
import math

from torch import nn

from .weight_quant import WeightQuant

_log = logging.getLogger("zerospeed.compression")


class MoQ:
    """The schedule of every MoQ weight of one model: ``layers`` are ``(weight, its WeightQuant)`` pairs."""

    def __init__(self, layers: list[tuple[nn.Parameter, WeightQuant]], mixed: bool = False,
                 change_ratio: float = 0.001, verbose: bool = False) -> None:
        self.layers = layers
        self.mixed, self.change_ratio, self.verbose = mixed, change_ratio, verbose
        self.qsteps = 0
        self.ratio = 1.0

    def quantize(self, overflow: bool = False, eigenvalue_enabled: bool = False,
                 block_eigenvalue: dict[int, tuple[float, int]] | None = None) -> None:
        """One step of the schedule (module docstring)."""
        if overflow and not eigenvalue_enabled:
            return
        self.qsteps += 1
        if self.mixed:
            self.ratio = self.ratio - self.change_ratio if self.ratio > 0 else 0.0
        for param, wq in self.layers:
            ev = (block_eigenvalue or {}).get(id(param))
            factor = 1 + math.floor(ev[0] * 4) if ev is not None else 1
            if wq.bits != wq.target_bits and self.qsteps >= wq.period:
                self.ratio = 1.0
                wq.period = (wq.period << 1) * factor
                wq.bits -= 1
                if self.verbose:
                    _log.info("MoQ: %d bits at step %d, next period %d", wq.bits, self.qsteps, wq.period)
            wq.ratio = self.ratio if self.mixed else 0.0
            wq.started = True

    def any_precision_switch(self) -> bool:
        """Whether the next step may lower some weight's bits (eigenvalues are only needed then)."""
        return any(wq.bits != wq.target_bits and self.qsteps + 1 >= wq.period for _, wq in self.layers)

    def state_dict(self) -> dict[str, object]:
        return {"qsteps": self.qsteps, "ratio": self.ratio,
                "layers": [(wq.bits, wq.period, wq.ratio, wq.started) for _, wq in self.layers]}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.qsteps, self.ratio = int(state["qsteps"]), float(state["ratio"])  # type: ignore[arg-type]
        for (_, wq), (bits, period, ratio, started) in zip(self.layers, state["layers"]):  # type: ignore[call-overload]
            wq.bits, wq.period, wq.ratio, wq.started = bits, period, ratio, started
