"""``ZeroSpeedTrainer``: the Hugging Face ``Trainer`` training through a zerospeed engine.

``ZeroSpeedTrainer(model, args, ..., zerospeed_config="ds_config.json")`` takes a DeepSpeed JSON (``"auto"``
values resolved from ``TrainingArguments``, as HF does for DeepSpeed). The Trainer's loop, data sharding
(Accelerate), logging, evaluation and callbacks stay HF's; what changes:

- the model is ``zerospeed.initialize``-d once training starts (HF's optimizer with its weight-decay groups and
  HF's scheduler when the config has none; the config's otherwise, stepped by the Trainer);
- each micro-batch's backward is the engine's ``backward`` + ``step`` (the engine applies the optimizer at the
  accumulation boundary the Trainer marks; the Trainer's own ``optimizer.step()`` is then a no-op, as with
  DeepSpeed under Accelerate); clipping is the engine's (``gradient_clipping`` = ``max_grad_norm``);
- checkpoints hold a zerospeed checkpoint (``resume_from_checkpoint`` restores weights, optimizer, schedule);
- ``save_model`` gathers the whole model at every stage and writes a ``from_pretrained`` directory (never the
  empty-weights file ZeRO-3 users get from DeepSpeed without ``stage3_gather_16bit_weights_on_model_save``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer

import zerospeed

from ...runtime.checkpoint.torch_file import save_torch
from . import auto

CHECKPOINT_TAG = "zerospeed"
SCHEDULER_FILE = "scheduler.pt"  # the Trainer's name for it


def _is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


class _EngineOptimizer:
    """What the Trainer calls ``self.optimizer``: the engine stepped already (in backward), so ``step`` and
    ``zero_grad`` do nothing; everything else (``param_groups``, ``state``, ...) is the engine's optimizer."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine.optimizer, name)


class _AppliedOnly:
    """An LR scheduler the Trainer steps after each optimizer step, advanced only when the engine applied the
    step (an fp16 overflow skips it, as DeepSpeed's own schedule does)."""

    def __init__(self, scheduler: Any, engine: Any) -> None:
        self._scheduler, self._engine = scheduler, engine

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._engine.was_step_applied():
            self._scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


class ZeroSpeedTrainer(Trainer):
    def __init__(self, *args: Any, zerospeed_config: str | Path | dict[str, Any] | None = None, **kwargs: Any) -> None:
        if zerospeed_config is None:
            raise ValueError("ZeroSpeedTrainer needs zerospeed_config=<DeepSpeed JSON path or dict>")
        super().__init__(*args, **kwargs)
        if getattr(self.args, "deepspeed", None):
            raise ValueError("TrainingArguments(deepspeed=...) starts DeepSpeed itself; pass the config as "
                             "ZeroSpeedTrainer(zerospeed_config=...) instead")
        self.zerospeed_config = auto.load(zerospeed_config)
        self.engine: Any = None

    # --- building the engine ---------------------------------------------------------------------------
    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        if self._created_lr_scheduler:
            self.lr_scheduler, self._created_lr_scheduler = None, False
        cfg = auto.resolve(self.zerospeed_config, self.args, self.model, max_steps)
        client = None if "optimizer" in cfg else self.create_optimizer()
        trainable = [p for p in self.model.parameters() if p.requires_grad] if client is None else None
        engine, _, _, engine_sched = zerospeed.initialize(model=self.model, optimizer=client,
                                                          model_parameters=trainable, config=cfg,
                                                          dist_init_required=False)
        self.engine = engine
        if engine_sched is not None:  # the config's schedule: the Trainer steps it once per optimizer step
            engine.lr_scheduler = None
            scheduler = engine_sched
        else:
            self.optimizer = client
            self.create_scheduler(num_training_steps=max_steps, optimizer=client)
            scheduler = self.lr_scheduler
        self.lr_scheduler = _AppliedOnly(scheduler, engine)
        self.optimizer = _EngineOptimizer(engine)
        self.accelerator.backward = self._engine_backward  # type: ignore[method-assign]
        # the engine defers its reduction to the boundary micro-step itself; Accelerate's no_sync would call the
        # engine's (which refuses at stages 2-3, as DeepSpeed's does)
        self.accelerator.no_sync = lambda model=None: contextlib.nullcontext()  # type: ignore[method-assign]
        self.model_wrapped = engine
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return engine, train_dataloader

    def _engine_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The Trainer already divided the loss for accumulation; the boundary is the Trainer's sync step."""
        kwargs.pop("scale_wrt_gas", None)
        if kwargs:
            raise TypeError(f"backward arguments {sorted(kwargs)} are not supported by zerospeed")
        self.engine.set_gradient_accumulation_boundary(self.accelerator.gradient_state.sync_gradients)
        self.engine.backward(loss, scale_wrt_gas=False)
        self.engine.step()

    def _clip_grad_norm(self, model: Any) -> None:
        return None  # the engine clips inside its step (gradient_clipping)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> float | None:
        return None if self.engine is None else self.engine.get_global_grad_norm()

    # --- checkpoints -----------------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Collective: the engine's checkpoint (weights, optimizer, counters) and the Trainer's schedule."""
        self.engine.save_checkpoint(output_dir, tag=CHECKPOINT_TAG, exclude_frozen_parameters=_is_peft(self.model))
        if self.args.should_save:
            save_torch(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE),
                       self.engine.config.checkpoint.checkpoint_serialization)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or self.engine is None:
            return
        path, _ = self.engine.load_checkpoint(checkpoint, tag=CHECKPOINT_TAG, load_module_strict=not _is_peft(self.model),
                                              load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"{checkpoint} holds no zerospeed checkpoint (written by ZeroSpeedTrainer)")
        sched_file = os.path.join(checkpoint, SCHEDULER_FILE)
        if os.path.isfile(sched_file):
            self.lr_scheduler.load_state_dict(torch.load(sched_file, weights_only=True))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective once training started: the whole model (gathered under ZeRO-3) as a ``from_pretrained``
        directory on the main process; PEFT models save their adapters only."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        state = self.engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=_is_peft(self.model))
        if self.args.should_save:
            self._save(output_dir, state_dict=state)
        return None
