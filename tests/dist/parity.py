"""Shared parity fixtures: a tiny model, deterministic global batches, and a single-process reference."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

D_IN, D_HID, D_OUT = 8, 16, 4


class TinyNet(nn.Module):
    """Two parameter groups worth of layers, a frozen parameter, and one parameter left unused."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, D_HID)
        self.fc2 = nn.Linear(D_HID, D_HID)
        self.head = nn.Linear(D_HID, D_OUT)
        self.frozen = nn.Parameter(torch.randn(D_HID) * 0.1, requires_grad=False)
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h) + self.frozen)
        return nn.functional.mse_loss(self.head(h), y)


def make_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def param_groups(model: TinyNet) -> list[dict[str, Any]]:
    decay = [model.fc1.weight, model.fc2.weight, model.head.weight, model.unused]
    no_decay = [model.fc1.bias, model.fc2.bias, model.head.bias, model.frozen]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3}]


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, D_IN, generator=g), torch.randn(size, D_OUT, generator=g)


def micro_batch(step: int, micro: int, rank: int, world: int, mb: int, gas: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, mb * gas * world)
    lo = (micro * world + rank) * mb
    return x[lo:lo + mb], y[lo:lo + mb]


def reference_losses(steps: int, mb: int, gas: int, world: int, clip: float, lr: float = 1e-2,
                     scheduler: dict[str, Any] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch on one process: the whole global batch, AdamW, global-norm clipping.

    ``scheduler`` ({"type", "params"}) is built on the plain optimizer and stepped after each step.
    """
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    sched = None
    if scheduler is not None:
        from zerospeed.optim import build_scheduler

        sched = build_scheduler(scheduler["type"], dict(scheduler["params"]), opt)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, mb * gas * world)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # as in DDP and DeepSpeed: no gradient means a zero gradient
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_losses(stage: int, steps: int, mb: int, gas: int, clip: float, lr: float = 1e-2,
                  extra: dict[str, Any] | None = None, probe: Any = None) -> Any:
    """The same run through zerospeed on the current process group; returns per-step global losses and the
    final state (and ``probe(engine)`` after the run as a third item, when given)."""
    import zerospeed
    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 300},
        "steps_per_print": 1000,
    }
    config.update(extra or {})
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    losses = []
    dev, dt = engine.device, engine.compute_dtype
    for step in range(steps):
        total = torch.zeros((), device=dev)
        for m in range(gas):
            x, y = micro_batch(step, m, rank, world, mb, gas)
            loss = engine(x.to(dev, dt), y.to(dev, dt))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / gas
        comm.all_reduce(total)
        losses.append(float(total) / world)
    state = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    return (losses, state) if probe is None else (losses, state, probe(engine))
