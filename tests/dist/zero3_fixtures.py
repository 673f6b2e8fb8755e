"""Stage-3 parity fixtures: a tiny model with tied embeddings, a layer used twice, nesting, a buffer,
a frozen parameter on the root; deterministic token batches; a single-process reference."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

V, D, T = 16, 8, 4


class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.shared = nn.Linear(D, D)
        self.block = nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight  # tied: both modules own the same parameter
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D))
        self.frozen = nn.Parameter(torch.randn(D) * 0.1, requires_grad=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(tokens)
        h = torch.tanh(self.shared(h))
        h = h + self.block(h)
        h = torch.tanh(self.shared(h))  # the shared layer again
        h = self.norm(h) * self.scale.to(h.dtype) + self.frozen  # buffers keep fp32 under bf16 (DeepSpeed)
        logits = self.head(h)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, V).float(), targets.reshape(-1))


def make_model(seed: int = 0) -> TiedNet:
    torch.manual_seed(seed)
    return TiedNet()


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, V, (size, T), generator=g), torch.randint(0, V, (size, T), generator=g)


def micro_batch(step: int, micro: int, rank: int, world: int, mb: int, gas: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, mb * gas * world)
    lo = (micro * world + rank) * mb
    return x[lo:lo + mb], y[lo:lo + mb]


OPT = {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


def reference(steps: int, mb: int, gas: int, world: int, clip: float) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """One process, whole global batch, AdamW, global-norm clipping; also an eval loss at the end."""
    model = make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=OPT["lr"], betas=tuple(OPT["betas"]), eps=OPT["eps"],
                            weight_decay=OPT["weight_decay"])
    losses = []
    for step in range(steps):
        x, y = global_batch(step, mb * gas * world)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        x, y = global_batch(999, 4)
        eval_loss = model.eval()(x, y).item()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, eval_loss


def config(stage: int, mb: int, gas: int, clip: float, **zero: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": dict(OPT)},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 300,
                              "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 200,
                              **zero},
        "steps_per_print": 1000,
    }


def run_engine(stage: int, steps: int, mb: int, gas: int, clip: float, extra: dict[str, Any] | None = None,
               zero: dict[str, Any] | None = None, build_in_init: bool = False) -> dict[str, Any]:
    """Train through zerospeed on the current group: global losses, full fp32 state, eval loss."""
    import zerospeed
    from zerospeed import comm
    from zerospeed.zero import Init, full_state_dict, shard_of

    world, rank = comm.get_world_size(), comm.get_rank()
    cfg = config(stage, mb, gas, clip, **(zero or {}))
    cfg.update(extra or {})
    if build_in_init:
        with Init(config_dict_or_path=cfg):
            model = make_model()
    else:
        model = make_model()
    engine, opt, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    shared = next((s for u in engine.zero3.fetcher.units if u.name == "shared" for s in u.shards), None) \
        if engine.zero3 is not None else None
    gathers = (0, 0)  # of shared.weight in the last micro-step: (forward, backward)
    for step in range(steps):
        total = torch.zeros(())
        for m in range(gas):
            x, y = micro_batch(step, m, rank, world, mb, gas)
            start = shared.gathers if shared is not None else 0
            loss = engine(x, y)
            mid = shared.gathers if shared is not None else 0
            engine.backward(loss)
            gathers = (mid - start, (shared.gathers if shared is not None else 0) - mid)
            engine.step()
            total += loss.detach().float() / gas
        comm.all_reduce(total)
        losses.append(float(total) / world)
    engine.eval()
    with torch.no_grad():
        x, y = global_batch(999, 4)
        eval_loss = float(engine(x, y))
    state = full_state_dict(model, rank0_only=False)
    fp32 = full_state_dict(model, optimizer=opt, fp32=True, rank0_only=False)
    return {"losses": losses, "state": {k: v.float() for k, v in state.items()}, "fp32": fp32,
            "eval": eval_loss, "memory": engine.memory_breakdown(),
            "prefetched": engine.zero3.fetcher.prefetched_numel if engine.zero3 is not None else 0,
            "gathers": gathers,
            "persistent": sorted(n for n, p in model.named_parameters()
                                 if engine.zero3 is not None and shard_of(p).persistent)}
