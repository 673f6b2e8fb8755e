"""The hybrid engine (DeepSpeed-Chat's RLHF step 3): one engine trains the actor and generates its rollouts.

A *rollout phase* runs from ``engine.eval()`` (or the first ``engine.generate()``) to ``engine.train()``::

    eval() -> generate() ... generate() -> train() -> forward / backward / step -> eval() -> ...

Inside a phase, with ``pin_parameters`` (DeepSpeed's default), the ZeRO-3 weights are gathered once, when the
first ``generate()`` starts, and held (``GatheredParameters``) until the phase ends: no per-token gathers.
The KV cache is a static cache of ``max_out_tokens`` positions per batch size, allocated on first use in the
phase and reset between calls. ``release_inference_cache`` gives both back after every ``generate()``; the
end of the phase always does; on the host the freed heap is then trimmed (``malloc_trim``: glibc would otherwise keep
the released pages resident, and RSS would not fall). Generation runs under ``no_grad`` and in eval mode and leaves every training
state alone (parameters, optimizer, counters, RNG of the training step), so a step after a rollout equals one
without it. Under stages 0-2 the weights are whole already and only the cache is managed. With
``inference_tp_size`` > 1 the phase generates tensor-parallel over groups of that many ranks from a split copy
of the weights (``hybrid_tp.py``) instead.
"""

from __future__ import annotations

import gc
import inspect
from typing import Any

import torch
from torch import nn

from ..accelerator import get_accelerator
from ..config.hybrid_engine import HybridEngineConfig
from ..profiling.memory_timeline import malloc_trim
from ..zero.stage3 import GatheredParameters


class HybridEngine:
    """The rollout phases of one engine's module (an HF ``GenerationMixin`` model)."""

    def __init__(self, section: HybridEngineConfig, module: nn.Module) -> None:
        if not callable(getattr(module, "generate", None)):
            raise ValueError("hybrid_engine.enabled needs a model with a Hugging Face generate() "
                             f"(transformers' GenerationMixin); {type(module).__name__} has none")
        self.section = section
        self.module = module
        self.gathered: GatheredParameters | None = None
        self.caches: dict[int, Any] = {}
        self.gathers = 0  # how many times the weights were gathered for generation (a count for tests and logs)
        self.tp = None
        self._on_host = all(p.device.type == "cpu" for p in module.parameters())
        if section.inference_tp_size > 1:
            from .hybrid_tp import TensorParallelRollout

            self.tp = TensorParallelRollout(module, section.inference_tp_size)

    @property
    def in_phase(self) -> bool:
        return self.gathered is not None or bool(self.caches) or (self.tp is not None and self.tp.engine is not None)

    def _gather(self) -> None:
        if self.section.pin_parameters and self.gathered is None:
            self.gathered = GatheredParameters(list(self.module.parameters()))
            self.gathered.__enter__()
            self.gathers += bool(self.gathered.shards)

    def _cache(self, batch: int) -> Any:
        """The phase's static KV cache for this batch size (None when the model's config cannot make one)."""
        if batch not in self.caches:
            try:
                from transformers import StaticCache
            except ImportError:  # pragma: no cover - transformers is what provides generate()
                return None
            config = getattr(self.module, "config", None)
            self.caches[batch] = StaticCache(config=config, max_cache_len=self.section.max_out_tokens) \
                if config is not None else None
        cache = self.caches[batch]
        if cache is not None:
            cache.reset()
        return cache

    def end_phase(self) -> None:
        """``engine.train()`` and ``engine.step()``: end an open phase (a no-op outside one)."""
        if self.in_phase:
            self.release()

    def release(self) -> None:
        """End the phase: the gathered weights go back to their shards, the caches are dropped."""
        if self.gathered is not None:
            gathered, self.gathered = self.gathered, None
            gathered.__exit__(None, None, None)
        self.caches.clear()
        if self.tp is not None:
            self.tp.release()
        gc.collect()
        get_accelerator().empty_cache()
        if self._on_host:  # glibc keeps freed heap resident: hand the released weights and cache back to the OS
            malloc_trim()

    def _check_length(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        ids = inputs[0] if inputs else kwargs.get("input_ids", kwargs.get("inputs"))
        if not torch.is_tensor(ids) or ids.dim() != 2:
            raise ValueError("engine.generate() needs input_ids of shape [batch, prompt length]")
        new = kwargs.get("max_new_tokens")
        total = kwargs.get("max_length") if new is None else ids.shape[1] + int(new)
        if total is None or total > self.section.max_out_tokens:
            raise ValueError(f"engine.generate(): prompt + new tokens = {total} must be given (max_new_tokens= or "
                             f"max_length=) and at most hybrid_engine.max_out_tokens = {self.section.max_out_tokens}")
        return int(ids.shape[0])

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """HF ``generate`` on the gathered weights, in eval mode, with the phase's KV cache."""
        batch = self._check_length(inputs, kwargs)
        was_training = self.module.training
        self.module.eval()
        try:
            if self.tp is not None:
                with torch.no_grad():
                    return self.tp.generate(*inputs, **kwargs)
            self._gather()
            if "cache" not in kwargs and "past_key_values" not in kwargs and _takes_cache(self.module):
                cache = self._cache(batch)
                if cache is not None:
                    kwargs["cache"] = cache
            with torch.no_grad():
                out = self.module.generate(*inputs, **kwargs)
        finally:
            if self.section.release_inference_cache:
                self.release()
            self.module.train(was_training)
        return out


def _takes_cache(module: nn.Module) -> bool:
    """Whether this transformers' ``generate`` names the cache ``cache`` (5.x; older ones: no phase cache)."""
    try:
        params = inspect.signature(module.generate).parameters
    except (TypeError, ValueError):
        return False
    return "cache" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def hybrid_engine(section: HybridEngineConfig, module: nn.Module) -> HybridEngine | None:
    return HybridEngine(section, module) if section.enabled else None
