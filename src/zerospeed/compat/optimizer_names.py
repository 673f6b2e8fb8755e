"""DeepSpeed's engine-optimizer class names, for the ``isinstance`` checks code makes on ``engine.optimizer``.

DeepSpeed wraps the optimizer in one of several classes (``DeepSpeedZeroOptimizer`` at stages 1-2,
``DeepSpeedZeroOptimizer_Stage3``, ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer`` / ``BF16_Optimizer`` at
stage 0), each with its own flat-buffer attributes. zerospeed's engine has one, ``ZeroOptimizer``
(``zero/optimizer.py``), at every stage, and none of those internals. So these names exist for the checks
only, and they answer truthfully: nothing is an instance of them; constructing one raises
``NotImplementedError`` naming zerospeed's class.
"""

from __future__ import annotations

from typing import Any


class _NotZerospeedsOptimizer:
    """Base of DeepSpeed's optimizer-wrapper names (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        raise NotImplementedError(f"DeepSpeed's {name} is not built by zerospeed: the engine wraps every optimizer "
                                  "in zerospeed.zero.optimizer.ZeroOptimizer (engine.optimizer); build the engine "
                                  "with zerospeed.initialize()")


class DeepSpeedZeroOptimizer(_NotZerospeedsOptimizer):
    """DeepSpeed's ZeRO 1-2 optimizer (``deepspeed.runtime.zero.stage_1_and_2``)."""


class DeepSpeedZeroOptimizer_Stage3(_NotZerospeedsOptimizer):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's ZeRO-3 optimizer (``deepspeed.runtime.zero.stage3``)."""


class FP16_Optimizer(_NotZerospeedsOptimizer):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's fused fp16 wrapper at stage 0 (``deepspeed.runtime.fp16.fused_optimizer``)."""


class FP16_UnfusedOptimizer(_NotZerospeedsOptimizer):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's unfused 16-bit wrapper at stage 0 (``deepspeed.runtime.fp16.unfused_optimizer``)."""


class BF16_Optimizer(_NotZerospeedsOptimizer):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's bf16 wrapper (``deepspeed.runtime.bf16_optimizer``)."""


__all__ = ["BF16_Optimizer", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "FP16_Optimizer",
           "FP16_UnfusedOptimizer"]
