"""A tiny MoE GPT (every block's MLP replaced by an MoE layer) and a plain single-process reference."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerospeed.models.gpt import GPT, MLP, GPTConfig
from zerospeed.moe.layer import MoE

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
NUM_EXPERTS = 4
AUX = 0.01
# Adam with an eps well above gradient rounding noise: the key bias's gradient is 0 up to rounding (softmax is
# shift-invariant), and Adam would turn that noise into lr-sized steps that differ between summation orders.
ADAM_EPS = 1e-3


class MoEMLP(nn.Module):
    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe
        self.l_aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, self.l_aux, _ = self.moe(x)
        return y


class MoEGPT(nn.Module):
    """forward(idx, targets) -> cross-entropy + AUX * sum of the layers' load-balancing losses."""

    def __init__(self, ep_size: int, k: int, ep_rank: int, seed: int = 0) -> None:
        super().__init__()
        self.gpt = GPT(CFG, seed)
        for i, block in enumerate(self.gpt.blocks):
            moe = MoE(CFG.n_embd, MLP(CFG), NUM_EXPERTS, ep_size, k, capacity_factor=1.0, min_capacity=1,
                      use_rts=False, top2_2nd_expert_sampling=False)
            block.mlp = MoEMLP(moe)
            _init_layer(moe, seed * 100 + i, ep_rank)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _, loss = self.gpt(idx, targets)
        return loss + AUX * sum(b.mlp.l_aux for b in self.gpt.blocks)

    def expert(self, layer: int, local: int) -> nn.Module:
        return self.gpt.blocks[layer].mlp.moe.deepspeed_moe.experts.deepspeed_experts[local]


@torch.no_grad()
def _init_layer(moe: MoE, seed: int, ep_rank: int) -> None:
    """Distinct experts, each drawn from its *global* id, so any ep_size builds the same model."""
    g = torch.Generator().manual_seed(seed)
    moe.deepspeed_moe.gate.wg.weight.copy_(torch.randn(moe.deepspeed_moe.gate.wg.weight.shape, generator=g) * 0.5)
    for local, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
        ge = torch.Generator().manual_seed(seed * 1000 + ep_rank * moe.num_local_experts + local)
        for p in expert.parameters():
            p.copy_(torch.randn(p.shape, generator=ge) * 0.1)


def batch(step: int, rank: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + 31 * step + rank)
    idx = torch.randint(0, CFG.vocab_size, (mb, CFG.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def reference(steps: int, world: int, mb: int, k: int, clip: float, lr: float,
              gas: int = 1, adam: bool = False,
              device: str = "cpu") -> tuple[list[list[float]], MoEGPT, dict[str, torch.Tensor]]:
    """Plain PyTorch, one process: each rank's micro-batch routed on its own (as on that rank), losses averaged.

    ``device``: where it runs. Capacity drops pick among tied gate masks with ``topk`` (DeepSpeed's rule with
    ``use_rts=False``), and CPU and CUDA break those ties differently, so a CUDA run is checked against a CUDA
    reference."""
    model = MoEGPT(1, k, 0).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=ADAM_EPS) if adam else torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        opt.zero_grad()
        # micro-step m of step s is global micro-step s * gas + m; its losses are reported per rank
        per_rank = [model(*(t.to(device) for t in batch(step * gas + m, r, mb))) for m in range(gas)
                    for r in range(world)]
        loss = sum(per_rank) / (world * gas)
        loss.backward()
        if step == 0:  # the first step's expert gradients, by global id
            for layer in range(len(model.gpt.blocks)):
                for gid in range(NUM_EXPERTS):
                    for n, p in model.expert(layer, gid).named_parameters():
                        grads[f"L{layer}.E{gid}.{n}"] = p.grad.clone()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
        opt.step()
        for m in range(gas):
            losses.append([float(x.detach()) for x in per_rank[m * world:(m + 1) * world]])
    return losses, model, grads


def engine_config(stage: int, clip: float, lr: float, mb: int, world: int, gas: int = 1) -> dict[str, Any]:
    """Stage 3 cuts every parameter (persistence threshold 0) and prefetches (a bucket of a few tensors)."""
    zero3 = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 600} if stage == 3 else {}
    return {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": gas,
            "train_batch_size": mb * world * gas, "gradient_clipping": clip,
            "optimizer": {"type": "SGD", "params": {"lr": lr}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 300, **zero3}}
