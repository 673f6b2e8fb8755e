"""A tiny GPT written as a PipelineModule layer list (tied embedding/head) and its plain-PyTorch reference."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.models.gpt import Block, GPTConfig
from zerospeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=16)
SEED = 1234


class Embed(nn.Module):
    def __init__(self, vocab: int, block: int, dim: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))


def head(embed: Embed, x: torch.Tensor) -> torch.Tensor:
    return x @ embed.wte.weight.t()


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def gpt_layers(cfg: GPTConfig = CFG) -> list[Any]:
    tie = dict(tied_weight_attr=["wte.weight"])
    return [TiedLayerSpec("embed", Embed, cfg.vocab_size, cfg.block_size, cfg.n_embd, **tie),
            *[LayerSpec(Block, cfg) for _ in range(cfg.n_layer)],
            LayerSpec(nn.LayerNorm, cfg.n_embd),
            TiedLayerSpec("embed", Embed, cfg.vocab_size, cfg.block_size, cfg.n_embd, forward_fn=head, **tie)]


def gpt_pipe(num_stages: int, **kwargs: Any) -> PipelineModule:
    return PipelineModule(gpt_layers(), num_stages=num_stages, loss_fn=loss_fn, seed_layers=True, base_seed=SEED,
                          partition_method=kwargs.pop("partition_method", "uniform"), **kwargs)


def batches(steps: int, micro: int, count: int, seed: int = 0) -> torch.Tensor:
    """[steps, count, micro, block+1] token windows."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (steps, count, micro, CFG.block_size + 1), generator=g)


def rank_iter(data: torch.Tensor, dp_rank: int, gas: int):
    """Micro-batches of one data-parallel replica: step s uses slots [dp_rank * gas, (dp_rank + 1) * gas)."""
    for s in range(data.shape[0]):
        for j in range(gas):
            w = data[s, dp_rank * gas + j]
            yield w[:, :-1], w[:, 1:]


def reference_losses(data: torch.Tensor, lr: float, clip: float, dtype: torch.dtype = torch.float32) -> list[float]:
    """Plain PyTorch, one process: the same layers built with the same per-layer seeds, AdamW, clipping."""
    modules: list[Any] = []
    tied: dict[str, nn.Module] = {}
    for idx, spec in enumerate(gpt_layers()):
        torch.manual_seed(SEED + idx)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build()
            m = tied[spec.key]
            modules.append(m if spec.forward_fn is None else (lambda x, m=m, f=spec.forward_fn: f(m, x)))
        else:
            modules.append(spec.build())
    params = list(dict.fromkeys(p for m in modules if isinstance(m, nn.Module) for p in m.parameters()))
    for p in params:
        p.data = p.data.to(dtype)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    out = []
    count = data.shape[1]
    for s in range(data.shape[0]):
        total = 0.0
        for j in range(count):
            x = data[s, j][:, :-1]
            for m in modules:
                x = m(x)
            loss = loss_fn(x.float(), data[s, j][:, 1:])
            (loss / count).backward()
            total += float(loss.detach())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad()
        out.append(total / count)
    return out
