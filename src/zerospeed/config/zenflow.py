"""``zero_optimization.zenflow``: DeepSpeed's ZenFlow (stall-free offload), its keys and defaults.

ZenFlow splits each step of a CPU-offloaded optimizer by importance: the top ``topk_ratio`` columns of
every 2-D weight (by summed gradient magnitude, chosen afresh every ``select_interval``) and every other
parameter are updated on the device at every step; the gradients of everything accumulate on the host
and the host's Adam applies them every ``update_interval`` steps, in a worker thread overlapping the next
steps when ``overlap_step`` (one interval stale). The algorithm lives in ``offload/zenflow/``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section


class ZenFlowConfig(Section):
    """DeepSpeed's ZenFlow keys. An iteration is one optimizer step (``gradient_accumulation_steps`` keeps its
    meaning; DeepSpeed instead sets it to ``update_interval``).

    ``select_strategy``: ``step`` (reselect every ``select_interval`` steps), ``epoch`` (every
    ``select_interval`` epochs of ``steps_per_epoch`` steps; no reselection when the epoch length is unknown),
    ``auto`` (``epoch`` with ``select_interval`` 1). ``update_interval``: host update every that many steps, or
    ``auto`` (when the accumulated unselected gradient mass outgrows the selected one on ``auto_ratio`` of
    the 2-D weights). ``full_warm_up_rounds``: first steps fully updated (no selection). ``offload``: keep
    the device-side (selected) Adam state in host memory between steps. ``pt_reserved_cores_perc``: with
    ``overlap_step``, the share of the cores kept by the training thread; the overlapped host update runs
    on the rest (offload/cores.py).
    """

    topk_ratio: float = Field(0.1, gt=0.0, lt=1.0)
    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    select_interval: Literal["auto"] | int = "auto"
    update_interval: Literal["auto"] | int = "auto"
    overlap_step: bool = False
    offload: bool = False
    auto_ratio: float = Field(0.99, ge=0.0, le=1.0)
    full_warm_up_rounds: int = Field(0, ge=0)
    steps_per_epoch: int | None = Field(None, ge=1)
    pt_reserved_cores_perc: float = Field(0.5, gt=0.0, lt=1.0)

    @model_validator(mode="after")
    def _check(self) -> ZenFlowConfig:
        if isinstance(self.update_interval, int) and self.update_interval < 1:
            raise ValueError(f"update_interval must be at least 1 or 'auto', got {self.update_interval}")
        if isinstance(self.select_interval, int) and self.select_interval < 0:
            raise ValueError(f"select_interval must be >= 0 or 'auto', got {self.select_interval}")
        if self.select_strategy == "auto" and isinstance(self.select_interval, int):
            raise ValueError("select_strategy 'auto' sets select_interval to 1 epoch; remove select_interval or "
                             "choose select_strategy 'step' or 'epoch' (DeepSpeed refuses this too)")
        if self.select_strategy != "auto" and not isinstance(self.select_interval, int):
            raise ValueError(f"select_strategy '{self.select_strategy}' needs a number for select_interval")
        interval = self.resolved_select_interval()
        if isinstance(self.update_interval, int) and interval != 0 and interval < self.update_interval:
            raise ValueError(f"select_interval ({interval} steps) must be >= update_interval ({self.update_interval})")
        return self

    def resolved_select_interval(self, steps_per_epoch: int | None = None) -> int:
        """Steps between reselections (0: select once, when warm-up ends), as DeepSpeed resolves it."""
        n = 1 if self.select_strategy == "auto" else int(self.select_interval)  # type: ignore[arg-type]
        if self.select_strategy == "step":
            return n
        epoch = steps_per_epoch or self.steps_per_epoch
        return n * epoch if epoch else 0
