"""Models whose flops profiles are compared with DeepSpeed's (``tests/unit/fixtures/deepspeed_flops.json``).

Each builder returns ``(model, args, mode)``: a seeded module, the forward's positional arguments and
``"eval"`` or ``"train"``. ``scripts/deepspeed_flops_reference.py`` runs DeepSpeed 0.19.8's profiler on
the same builders and writes the fixture; ``test_flops_deepspeed_parity.py`` runs ours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def conv_net() -> nn.Module:
    """A small CNN: conv, batch norm, ReLU, max pool, adaptive average pool, linear with bias, softmax."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, stride=2, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10), nn.Softmax(dim=-1),
    )


class Zoo(nn.Module):
    """One of everything DeepSpeed has a convention for (and a few it does not count)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, padding="same", groups=2)
        self.conv1d = nn.Conv1d(6, 4, 3, stride=2, dilation=2)
        self.deconv = nn.ConvTranspose2d(6, 4, 3, stride=2)
        self.acts = nn.ModuleList([nn.Tanh(), nn.GELU(), nn.SiLU(), nn.LeakyReLU(), nn.ELU(), nn.PReLU(),
                                   nn.Sigmoid(), nn.Hardswish(), nn.ReLU6()])
        self.pools = nn.ModuleList([nn.AvgPool2d(2), nn.MaxPool2d(2, return_indices=False),
                                    nn.AdaptiveMaxPool2d(3)])
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.gn = nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.ln = nn.LayerNorm(8, elementwise_affine=False)
        self.emb = nn.Embedding(10, 8)
        self.drop = nn.Dropout(0.0)
        self.mha = nn.MultiheadAttention(8, 2)
        self.lstm = nn.LSTM(8, 5, num_layers=2)
        self.gru = nn.GRUCell(8, 3)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)                                    # (2, 6, 8, 8)
        for act in self.acts:
            h = act(h)
        d = self.deconv(h)                                  # (2, 4, 17, 17)
        d = self.gn(d) + self.inorm(d)
        p0, p1, p2 = (pool(d).sum() for pool in self.pools)
        p = p0 + p1 + p2  # operators: not counted (sum() over tensors would be, see rules.py)
        u = self.up(d[:, :, :4, :4])                        # (2, 4, 8, 8)
        c1 = self.conv1d(h.flatten(2)[..., :20])            # (2, 4, 6)
        e = self.ln(self.drop(self.emb(ids)))               # (2, 5, 8)
        a = torch.matmul(e, e.transpose(1, 2)) @ e          # (2, 5, 8)
        a = torch.bmm(a, e.transpose(1, 2)).softmax(-1)     # (2, 5, 5) Tensor.softmax: not counted by DeepSpeed
        a = F.softmax(a, dim=-1)
        m = torch.mm(e[0], e[1].t())                       # (5, 5)
        m = m + torch.addmm(e[0, :, 0], e[0], e[1].t()) + m.addmm(e[0], e[1].t())
        m = torch.mul(m, 2.0) * m + torch.add(m, m).mul(m).add(1.0) + torch.tanh(m)
        s = torch.einsum("bij,bjk->bik", a, e) + torch.baddbmm(e, a, e)
        attn = F.scaled_dot_product_attention(s[:, None], e[:, None], e[:, None], is_causal=True)
        q = e.transpose(0, 1)                               # (5, 2, 8): (L, N, E)
        mh, _ = self.mha(q, q, q)
        out, _ = self.lstm(mh)
        g = self.gru(e[:, 0])
        return (p + u.sum() + c1.sum() + m.sum() + attn.sum() + out.sum() + g.sum()).reshape(1)


def zoo_inputs() -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 4, 8, 8, generator=gen), torch.randint(0, 10, (2, 5), generator=gen)


def zerospeed_gpt() -> nn.Module:
    from zerospeed.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32))


def hf_gpt2(attn: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    config._attn_implementation = attn
    return GPT2LMHeadModel(config)


def token_inputs() -> tuple[Any, ...]:
    return (torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0)),)


def _conv_inputs() -> tuple[Any, ...]:
    return (torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)),)


# name -> (builder, inputs, mode)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]], str]] = {
    "conv_net_eval": (conv_net, _conv_inputs, "eval"),
    "conv_net_train": (conv_net, _conv_inputs, "train"),
    "zoo_eval": (Zoo, zoo_inputs, "eval"),
    "zerospeed_gpt": (zerospeed_gpt, token_inputs, "eval"),
    "hf_gpt2_eager": (lambda: hf_gpt2("eager"), token_inputs, "eval"),
    "hf_gpt2_sdpa": (lambda: hf_gpt2("sdpa"), token_inputs, "eval"),
}


def build(name: str) -> tuple[nn.Module, tuple[Any, ...]]:
    """The case's model (seeded, in its mode) and inputs."""
    builder, inputs, mode = CASES[name]
    torch.manual_seed(0)
    model = builder()
    model.train(mode == "train")
    return model, inputs()
