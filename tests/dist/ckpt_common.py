"""Shared helpers of the checkpoint tests: build the parity engine, train a few steps, read the full state."""

from __future__ import annotations

from typing import Any

import torch

from .parity import make_model, micro_batch, param_groups

import zerospeed.runtime.checkpoint  # noqa: E402,F401  (imported before the harness forks)

MB = 2
GLOBAL_MICRO = 4  # micro-batches per step over all ranks: gas = GLOBAL_MICRO // world keeps the global batch fixed


def build(stage: int, extra: dict[str, Any] | None = None, lr: float = 1e-2, clip: float = 0.5) -> Any:
    import zerospeed
    from zerospeed import comm

    world = comm.get_world_size()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GLOBAL_MICRO // world,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": 4}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 300},
        "steps_per_print": 1000,
    }
    if stage == 3:  # partition every parameter (the tiny model would otherwise stay whole)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    config.update(extra or {})
    model = make_model()
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def train(engine: Any, steps: int) -> list[float]:
    """``steps`` optimizer steps starting at ``engine.global_steps``; returns the global mean losses."""
    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    gas = engine.gradient_accumulation_steps()
    losses = []
    for _ in range(steps):
        step = engine.global_steps
        total = torch.zeros(())
        for m in range(gas):
            x, y = micro_batch(step, m, rank, world, MB, gas)
            loss = engine(x.to(engine.compute_dtype), y.to(engine.compute_dtype))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / gas
        comm.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def full_state(engine: Any, fp32: bool = False) -> dict[str, torch.Tensor]:
    """The full model (collective; works under stage 3 too); ``fp32`` takes trainable params from the masters."""
    from zerospeed.zero import full_state_dict

    sd = full_state_dict(engine.module, engine.optimizer, fp32=fp32, rank0_only=False)
    return {k: v.detach().clone() for k, v in sd.items()}
