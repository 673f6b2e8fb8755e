"""The precision plugin of the zerospeed strategies: backward and step go through the engine.

Lightning already divides the loss by ``accumulate_grad_batches``, so the engine's backward does not divide
again (Lightning's DeepSpeed plugin lets DeepSpeed divide a second time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision

_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16,
           "16-true": torch.float16, "32-true": torch.float32}


class ZeroSpeedPrecision(Precision):
    """fp32, fp16 or bf16 as the zerospeed engine does it (master weights, loss scaling in the engine)."""

    def __init__(self, precision: str = "32-true") -> None:
        precision = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}.get(str(precision), str(precision))
        if precision not in _DTYPES:
            raise ValueError(f"precision {precision!r} is not supported with zerospeed; one of {sorted(_DTYPES)}")
        self.precision = precision
        self.dtype = _DTYPES[precision]

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module  # the engine casts the model to its compute dtype

    def convert_input(self, data: Any) -> Any:
        from lightning.fabric.utilities.apply_func import apply_to_collection

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.dtype) if torch.is_floating_point(t) else t

        return apply_to_collection(data, torch.Tensor, cast)

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        engine = model.trainer.model
        engine.backward(tensor, *args, scale_wrt_gas=False, **kwargs)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise RuntimeError("returning None from training_step (skipping backward) is not supported with zerospeed: "
                               "every rank must take part in each step")
        return model.trainer.model.step(**kwargs)

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """The engine clips (``gradient_clipping``, from ``Trainer(gradient_clip_val=...)``)."""
