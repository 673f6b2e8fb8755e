"""Fixtures for the ZeRO-3 extras (leaf modules, granularity, fetch modes, MiCS): an MoE model whose
ranks route to different experts, a run of a few steps through zerospeed, and a one-process reference."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

V, D, E, T = 64, 8, 4, 4  # vocabulary, width, experts, tokens per sample
OPT = {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class LoopMoeBlock(nn.Module):
    """transformers-4 Mixtral style: a gate and a loop over the experts that got tokens (only those run).
    Routing is by token id (expert = id mod E), weighted by the gate, so the data decides the experts."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def forward(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        flat, ids = h.reshape(-1, D), tokens.reshape(-1) % E
        weight = torch.softmax(self.gate(flat), dim=-1).gather(1, ids[:, None])
        out = torch.zeros_like(flat)
        for e in torch.unique(ids).tolist():  # the experts this rank's tokens route to
            rows = (ids == e).nonzero().squeeze(1)
            out = out.index_add(0, rows, self.experts[e](flat[rows]) * weight[rows])
        return out.view_as(h)


class HFMoeBlock(nn.Module):
    """Hugging Face's MixtralSparseMoeBlock (built from a tiny config, nothing downloaded)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = MixtralConfig(hidden_size=D, intermediate_size=2 * D, num_local_experts=E, num_experts_per_tok=2)
        self.moe = MixtralSparseMoeBlock(cfg)
        with torch.no_grad():
            for p in self.moe.parameters():
                p.normal_(0.0, 0.3)

    def forward(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        out = self.moe(h)
        return out[0] if isinstance(out, tuple) else out


class MoeNet(nn.Module):
    def __init__(self, hf: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.block = HFMoeBlock() if hf else LoopMoeBlock()
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.block(h, tokens)
        return F.cross_entropy(self.head(self.norm(h)).reshape(-1, V), targets.reshape(-1))


def _reinit(m: nn.Module) -> None:
    """A parent's weight re-initialisation through ``apply`` (as Hugging Face's ``post_init`` does)."""
    if isinstance(m, nn.Linear):
        m.weight.data.mul_(0.5)
        if m.bias is not None:
            nn.init.constant_(m.bias, 0.01)


def make_model(hf: bool = False, reinit: bool = False) -> MoeNet:
    torch.manual_seed(0)
    model = MoeNet(hf)
    if reinit:
        model.apply(_reinit)
    return model


def micro_batch(step: int, rank: int, world: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's tokens all route to experts r and r + world (mod E): the ranks run different experts."""
    g = torch.Generator().manual_seed(3000 + 31 * step + rank)
    choices = torch.tensor([t for t in range(V) if t % E % world == rank % world])
    tokens = choices[torch.randint(0, len(choices), (mb, T), generator=g)]
    return tokens, torch.randint(0, V, (mb, T), generator=g)


def global_batch(step: int, world: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [micro_batch(step, r, world, mb) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def reference(steps: int, world: int, mb: int, hf: bool = False, reinit: bool = False) -> list[float]:
    """One process, the whole global batch, AdamW."""
    model = make_model(hf, reinit)
    opt = torch.optim.AdamW(model.parameters(), lr=OPT["lr"], betas=tuple(OPT["betas"]), eps=OPT["eps"],
                            weight_decay=OPT["weight_decay"])
    losses = []
    for step in range(steps):
        loss = model(*global_batch(step, world, mb))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train(zero: dict[str, Any], steps: int, mb: int = 2, hf: bool = False, leaves: tuple[str, ...] = (),
          ranks_per_node: int | None = None, save_to: str | None = None, in_init: bool = False,
          modify_gathered: bool = False, root: dict[str, Any] | None = None) -> dict[str, Any]:
    """A few steps of ZeRO-3 through zerospeed on the current group: global losses, units, gathers."""
    import os

    import zerospeed
    from zerospeed import comm
    from zerospeed.utils import set_z3_leaf_modules

    rank, world = comm.get_rank(), comm.get_world_size()
    if ranks_per_node is not None:  # simulated nodes (the launcher's variable)
        os.environ["ZEROSPEED_RANKS_PER_NODE"] = str(ranks_per_node)
    cfg = {"train_micro_batch_size_per_gpu": mb, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": dict(OPT)},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 200, "reduce_bucket_size": 300, **zero},
           **(root or {})}
    if in_init:  # built partitioned; its apply(_reinit) runs on cut parameters
        with zerospeed.zero.Init(config_dict_or_path=cfg):
            model = make_model(hf, reinit=True)
    else:
        model = make_model(hf)
    if leaves:
        set_z3_leaf_modules(model, list(leaves))
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses, ops = [], []
    for step in range(steps):
        comm.COMMS_LOGGER.reset()
        loss = engine(*micro_batch(step, rank, world, mb))
        engine.backward(loss)
        engine.step()
        snap = comm.COMMS_LOGGER.snapshot()
        ops.append({k: v.count for k, v in snap.items()})
        groups = {k: sorted(v.groups) for k, v in snap.items()}  # the last step's: op -> the groups it ran on
        total = loss.detach().clone()
        comm.all_reduce(total)
        losses.append(float(total) / world)
    os.environ.pop("ZEROSPEED_RANKS_PER_NODE", None)
    refused = None
    if modify_gathered:  # a change inside GatheredParameters without a modifier rank
        try:
            with zerospeed.zero.GatheredParameters(model.head.weight):
                model.head.weight.data.add_(1.0)
        except Exception as exc:  # noqa: BLE001 - the error's name is what the test checks
            refused = type(exc).__name__
    if save_to is not None:
        try:
            engine.save_checkpoint(save_to)
        except Exception as exc:  # noqa: BLE001 - the message is what the test checks
            refused = f"{type(exc).__name__}: {exc}"
    z3 = engine.zero3
    return {"losses": losses, "units": [u.name for u in z3.units] if z3 else [], "ops": ops,
            "param_bytes": z3.param_bytes() if z3 else 0, "groups": groups, "refused": refused}


def train_each(runs: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """``train(**run, steps=steps)`` for each run, in one set of forked ranks (one fork, several engines)."""
    return [train(steps=steps, **run) for run in runs]
