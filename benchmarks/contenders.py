"""The training setups a benchmark compares; each turns (model, spec) into a ``Trainer`` inside one rank.

Every contender does the same math per optimizer step: ``micro_batches`` forward/backward passes with the
loss divided by the number of micro-batches in the global batch, gradients averaged over ranks, gradient
norm clipped to ``spec.clip``, one AdamW step at a constant learning rate. So their losses agree to float
tolerance and only the machinery differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from zerospeed.models import PRESETS, GPTConfig

Batch = tuple[torch.Tensor, torch.Tensor]

# The size sweep's shapes (issue 38) beside the library's presets: ~7M and ~27M with an 8192-token vocabulary
# (the byte corpus's tokens are < 256, so a wider vocabulary only widens the embedding and head), and GPT-2
# medium's shape (24 layers, width 1024, vocabulary 50257) at seq 256 instead of 1024, so a CPU step stays in
# seconds. Registered into ``PRESETS`` so forked ranks and the harness resolve them by name.
SWEEP_SHAPES = {
    "7m": lambda: GPTConfig(vocab_size=8192, block_size=256, n_layer=4, n_head=5, n_embd=320),
    "27m": lambda: GPTConfig(vocab_size=8192, block_size=256, n_layer=6, n_head=8, n_embd=560),
    "350m": lambda: GPTConfig(vocab_size=50257, block_size=256, n_layer=24, n_head=16, n_embd=1024),
}
PRESETS.update(SWEEP_SHAPES)


@dataclass(frozen=True)
class BenchSpec:
    """What every contender trains: model preset, global batch, steps and optimizer settings."""

    preset: str = "demo"
    micro_batch: int = 8
    grad_accum: int = 2  # per rank at ``world_size``; one-process contenders accumulate ``grad_accum * world_size``
    world_size: int = 2
    warmup: int = 2
    steps: int = 10
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.1
    clip: float = 1.0
    device: str = "cpu"  # "cuda": one device per rank (NCCL), bf16 below means autocast / zerospeed's bf16 section
    dtype: str = "fp32"  # "fp32" or "bf16"

    def global_micro_batches(self) -> int:
        return self.grad_accum * self.world_size


class Trainer(Protocol):
    def step(self, micro_batches: list[Batch]) -> float:
        """One optimizer step over this rank's micro-batches; returns this rank's mean loss."""
        ...

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds (params, grads, optimizer state, total)."""
        ...

    def comm_bytes(self) -> int | None:
        """Bytes this rank communicated in the last optimizer step (ZeRO convention), None if not counted."""
        ...


@dataclass(frozen=True)
class Contender:
    """A named setup: ``make`` builds its trainer in each rank; ``skip`` says why it cannot run (or None)."""

    name: str
    make: Callable[[nn.Module, BenchSpec], Trainer]
    world_size: int | None = None  # None: spec.world_size
    threads: int = 1  # intra-op threads per rank
    skip: Callable[[], str | None] = field(default=lambda: None)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor shards count their local part


def count_state(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Per-rank bytes of distinct parameter, gradient and optimizer-state tensors."""
    seen: dict[int, torch.Tensor] = {}  # holds the tensors, so an id cannot be reused while counting

    def size(ts: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in ts:
            if id(t) not in seen:
                seen[id(t)] = t
                local = _local(t)
                total += local.numel() * local.element_size()
        return total

    params = list(params)
    out = {"params": size(params), "grads": size(p.grad for p in params if p.grad is not None)}
    states = (v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    out["optimizer"] = size(states)
    out["total"] = sum(out.values())
    return out


def _adamw(params: Iterable[nn.Parameter], spec: BenchSpec, fused: bool | None = None) -> torch.optim.Optimizer:
    """torch's AdamW: its default implementation (foreach), or its fused kernel (``fused=True``)."""
    return torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=spec.weight_decay,
                             fused=fused)


class TorchTrainer:
    """Plain PyTorch: one process, DDP or FSDP2 — ``no_sync(i)`` returns the context for micro-batch i."""

    def __init__(self, model: nn.Module, spec: BenchSpec, wrapped: nn.Module, no_sync: Callable[[bool], Any],
                 fused: bool | None = None):
        self.model, self.wrapped, self.no_sync = model, wrapped, no_sync
        self.params = [p for p in wrapped.parameters()]
        self.opt = _adamw(self.params, spec, fused)
        self.clip = spec.clip
        self.autocast = torch.autocast(spec.device, dtype=torch.bfloat16, enabled=spec.dtype == "bf16")

    def step(self, micro_batches: list[Batch]) -> float:
        self.opt.zero_grad(set_to_none=True)  # at the start, so state_bytes() after a step still sees grads
        total = 0.0
        for i, (x, y) in enumerate(micro_batches):
            with self.no_sync(i < len(micro_batches) - 1):
                with self.autocast:
                    _, loss = self.wrapped(x, y)
                (loss / len(micro_batches)).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        return total / len(micro_batches)

    def state_bytes(self) -> dict[str, int]:
        return count_state(self.params, self.opt)

    def comm_bytes(self) -> int | None:
        return None  # torch's collectives are not counted


def _place(model: nn.Module, spec: BenchSpec) -> nn.Module:
    """Torch contenders build on the rank's device (zerospeed's engine and DeepSpeed move the model themselves)."""
    return model.to(torch.device(spec.device, torch.cuda.current_device()) if spec.device == "cuda" else "cpu")


def make_single(model: nn.Module, spec: BenchSpec) -> Trainer:
    from contextlib import nullcontext

    model = _place(model, spec)
    return TorchTrainer(model, spec, model, lambda _skip: nullcontext())


def make_ddp(model: nn.Module, spec: BenchSpec, fused: bool | None = None) -> Trainer:
    from contextlib import nullcontext

    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _place(model, spec)
    ddp = DDP(model, gradient_as_bucket_view=True,
              device_ids=[torch.cuda.current_device()] if spec.device == "cuda" else None)
    return TorchTrainer(model, spec, ddp, lambda skip: ddp.no_sync() if skip else nullcontext(), fused)


def make_fsdp2(model: nn.Module, spec: BenchSpec, reshard_after_forward: bool = True) -> Trainer:
    from contextlib import contextmanager

    from torch.distributed.fsdp import fully_shard

    model = _place(model, spec)
    for block in model.blocks:  # type: ignore[attr-defined]
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)

    @contextmanager
    def no_sync(skip: bool) -> Any:
        model.set_requires_gradient_sync(not skip)  # type: ignore[operator]
        yield

    return TorchTrainer(model, spec, model, no_sync)


def engine_step(engine: Any, micro_batches: list[Batch]) -> float:
    """One optimizer step through a DeepSpeed-style engine (zerospeed's or DeepSpeed's); mean loss."""
    total = 0.0
    for x, y in micro_batches:
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total += loss.item()
    return total / len(micro_batches)


class ZeroSpeedTrainer:
    """zerospeed's engine, configured by a ds_config dict equivalent to the torch baselines."""

    def __init__(self, model: nn.Module, spec: BenchSpec, stage: int, zero_extra: dict[str, Any] | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        import zerospeed

        config = {
            "train_micro_batch_size_per_gpu": spec.micro_batch,
            "gradient_accumulation_steps": spec.grad_accum,
            "gradient_clipping": spec.clip,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": spec.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": spec.weight_decay}},
            "zero_optimization": {"stage": stage, **(zero_extra or {})},
            "bf16": {"enabled": spec.dtype == "bf16"},
            **(extra or {}),
        }
        self.engine, self.opt, _, _ = zerospeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )

    def step(self, micro_batches: list[Batch]) -> float:
        return engine_step(self.engine, micro_batches)

    def state_bytes(self) -> dict[str, int]:
        if hasattr(self.engine, "memory_breakdown"):
            return {k: int(v) for k, v in self.engine.memory_breakdown().items() if isinstance(v, (int, float))}
        return count_state(self.engine.module.parameters(), self.opt)

    def comm_bytes(self) -> int | None:
        return getattr(self.engine, "last_step_comm_volume", None)


class DeepSpeedTrainer:
    """DeepSpeed 0.19.8 on CPU (fp32, Gloo), configured like ``ZeroSpeedTrainer``; no JIT-built C++ ops."""

    def __init__(self, model: nn.Module, spec: BenchSpec, stage: int) -> None:
        import warnings

        import deepspeed
        import deepspeed.ops

        warnings.filterwarnings("ignore", category=FutureWarning)  # its reduce_scatter_tensor etc. (torch 2.13)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip the ~3 min g++ build of shm comm
        config = {
            "train_micro_batch_size_per_gpu": spec.micro_batch,
            "gradient_accumulation_steps": spec.grad_accum,
            "gradient_clipping": spec.clip,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": spec.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": spec.weight_decay, "torch_adam": True}},
            "zero_optimization": {"stage": stage},
        }
        self.stage = stage
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config=config)

    def step(self, micro_batches: list[Batch]) -> float:
        return engine_step(self.engine, micro_batches)

    def state_bytes(self) -> dict[str, int]:
        """Local parameters (stage 3: partitions and persistent ones), fp32 master partitions, optimizer state.

        DeepSpeed's gradient buffers are internal and mostly freed after the step: not counted.
        """
        seen: set[int] = set()

        def size(t: torch.Tensor) -> int:
            key = t.untyped_storage().data_ptr()
            if t.numel() == 0 or key in seen:
                return 0
            seen.add(key)
            return t.untyped_storage().nbytes()

        params = 0
        for p in self.engine.module.parameters():
            ds = getattr(p, "ds_tensor", None)
            persistent = getattr(p, "ds_persist", False)
            params += size(p.data) if ds is None or persistent else size(ds)
        base = getattr(self.opt, "optimizer", self.opt)  # ZeRO wraps the torch optimizer
        master = sum(size(p) for g in base.param_groups for p in g["params"])
        state = sum(size(v) for s in base.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.numel() > 1)
        return {"params": params, "master": master, "optimizer": state, "total": params + master + state}

    def comm_bytes(self) -> int | None:
        return None


def deepspeed_missing() -> str | None:
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401  (imported in the parent once, so forked ranks start warm)
    except Exception as exc:  # noqa: BLE001 - any import failure means: not available here
        return f"deepspeed is not importable ({type(exc).__name__}: {exc}); pip install deepspeed==0.19.8"
    return None


def deepspeed_stage(stage: int, device: str = "cpu") -> Contender:
    skip = deepspeed_missing if device == "cpu" else (lambda: "the DeepSpeed contender runs on CPU only (fp32, Gloo)")
    return Contender(f"DeepSpeed stage {stage}", lambda m, s: DeepSpeedTrainer(m, s, stage), skip=skip)


def zerospeed_missing() -> str | None:
    try:
        import zerospeed
    except ImportError as exc:  # pragma: no cover - the project is installed editable
        return f"zerospeed is not importable: {exc}"
    if not hasattr(zerospeed, "initialize"):
        return "zerospeed.initialize does not exist yet (engine not written)"
    return None


def single(threads: int = 1) -> Contender:
    return Contender("one process", make_single, world_size=1, threads=threads)


def ddp(fused: bool = False) -> Contender:
    """torch DDP with torch's default AdamW, or (``fused``) with its fused kernel, zerospeed's default on host
    parameters: the row that separates the optimizer kernel from the engine."""
    if fused:
        return Contender("torch DDP, fused AdamW", lambda m, s: make_ddp(m, s, fused=True))
    return Contender("torch DDP", make_ddp)


def fsdp2(reshard_after_forward: bool = True, name: str = "torch FSDP2") -> Contender:
    return Contender(name, lambda m, s: make_fsdp2(m, s, reshard_after_forward))


def zerospeed_stage(stage: int, zero_extra: dict[str, Any] | None = None, name: str | None = None,
                    extra: dict[str, Any] | None = None) -> Contender:
    """zerospeed at ZeRO ``stage``; ``zero_extra``: more ``zero_optimization`` keys; ``extra``: top-level keys."""
    return Contender(name or f"zerospeed stage {stage}",
                     lambda m, s: ZeroSpeedTrainer(m, s, stage, zero_extra, extra), skip=zerospeed_missing)


def untrimmed(c: Contender) -> Contender:
    """``c`` with the engine's heap trimming off (``ZEROSPEED_TRIM_HEAP=0`` in its ranks), for a paired before/after."""

    def make(model: Any, spec: BenchSpec) -> Any:
        import os

        os.environ["ZEROSPEED_TRIM_HEAP"] = "0"  # a forked rank's own environment
        return c.make(model, spec)

    return Contender(f"{c.name}, no heap trim", make, c.world_size, c.threads, c.skip)


def world_of(contender: Contender, spec: BenchSpec) -> int:
    return contender.world_size or spec.world_size
