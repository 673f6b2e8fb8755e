"""A tiny attention model whose SparseSelfAttention comes from the config's ``sparse_attention`` section trains
under ZeRO-2 at world 2 with the losses of the same model in one process (random BigBird blocks drawn
differently per rank become rank 0's on the first forward)."""

import random

import torch
from torch import nn

from zerospeed.testing import run_distributed

SEQ, HID, HEADS, MB, STEPS = 32, 16, 2, 2, 3
CONFIG = {
    "train_micro_batch_size_per_gpu": MB,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 2},
    "sparse_attention": {"mode": "bigbird", "block": 8, "num_random_blocks": 1, "num_sliding_window_blocks": 1},
}


class TinyAttention(nn.Module):
    def __init__(self, sparsity_config) -> None:
        from zerospeed.ops.sparse_attention import SparseSelfAttention

        super().__init__()
        self.qkv = nn.Linear(HID, 3 * HID)
        self.out = nn.Linear(HID, HID)
        self.attn = SparseSelfAttention(sparsity_config, max_seq_length=SEQ)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(x.shape[0], SEQ, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        h = self.attn(q, k, v).transpose(1, 2).reshape(x.shape)
        return nn.functional.mse_loss(self.out(h), y)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(2 * MB, SEQ, HID, generator=g), torch.randn(2 * MB, SEQ, HID, generator=g)


def build(rank_seed: int) -> TinyAttention:
    from zerospeed.config import load_config

    random.seed(rank_seed)  # the random blocks: different per rank unless synchronised
    sparsity = load_config(CONFIG).sparse_attention.sparsity_config(num_heads=HEADS)
    torch.manual_seed(0)
    return TinyAttention(sparsity)


def _rank() -> list[float]:
    import zerospeed
    from zerospeed import comm

    rank = comm.get_rank()
    model = build(100 + rank)
    engine, _, _, _ = zerospeed.initialize(model=model, config=CONFIG)
    assert engine.config.sparse_attention.to_dict()["mode"] == "bigbird"
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = engine(x[rank * MB:(rank + 1) * MB], y[rank * MB:(rank + 1) * MB])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        comm.all_reduce(total)
        losses.append(float(total) / 2)
    return losses


def test_sparse_attention_model_zero2_parity() -> None:
    model = build(100)  # rank 0's draw
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    ref = []
    for step in range(STEPS):
        loss = model(*batch(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref.append(loss.item())
    for losses in run_distributed(_rank, 2, timeout=120):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-7)
