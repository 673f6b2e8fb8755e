"""Assembly of the data side: the training loader (plain or curriculum-sampled) and the data-efficiency
schedules (curriculum / progressive layer drop / random-LTD)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ..config import ZeroSpeedConfig
from ..config.batch import BatchSizes
from .dataloader import build_dataloader
from .plan import TrainPlan


def training_loader(cfg: ZeroSpeedConfig, training_data: Any, batch: BatchSizes, grids: Any,
                    collate_fn: Callable[..., Any] | None, zero_opt: Any) -> Any:
    """The loader ``initialize()`` returns (None without ``training_data``)."""
    curriculum = cfg.data_efficiency.data_sampling.curriculum_learning.enabled
    if training_data is None:
        if curriculum:
            warnings.warn("data_efficiency.data_sampling.curriculum_learning is enabled but initialize() got no "
                          "training_data: the curriculum sampler drives only the training loader initialize() builds")
        return None
    if cfg.data_efficiency.data_sampling.dynamic_batching.enabled:  # DeepSpeed's initialize() ignores it here too
        warnings.warn("data_efficiency.data_sampling.dynamic_batching is enabled: the loader initialize() returns "
                      "has fixed batches; build the packed loader and its scaled LR schedule with "
                      "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(dataset, engine, ...)")
    if curriculum:
        from ..data_pipeline.sampler import build_curriculum_dataloader  # DeepSpeed's curriculum data sampler

        return build_curriculum_dataloader(cfg.data_efficiency, training_data, batch.micro_batch_per_gpu,
                                           grids.data_rank, grids.data_size, grids.data_group,
                                           batch.gradient_accumulation_steps, collate_fn, cfg.dataloader_drop_last)
    loader = build_dataloader(training_data, batch.micro_batch_per_gpu, grids.data_rank, grids.data_size, collate_fn,
                              cfg.dataloader_drop_last, seed=cfg.seed or 0)
    if hasattr(getattr(zero_opt, "stepper", None), "set_steps_per_epoch") and hasattr(loader.dataset, "__len__"):
        zero_opt.stepper.set_steps_per_epoch(len(loader) // batch.gradient_accumulation_steps)  # ZenFlow's epochs
    return loader


def data_efficiency(plan: TrainPlan, cfg: ZeroSpeedConfig, global_batch: int) -> Any:
    """Curriculum / progressive layer drop / random-LTD schedules (data_pipeline/runtime.py), or None."""
    from ..data_pipeline.runtime import DataEfficiency

    state = DataEfficiency(cfg.curriculum_learning, cfg.progressive_layer_drop, cfg.data_efficiency, global_batch)
    return state if plan.data_efficiency else None  # (built anyway: it warns about flags that change nothing)
