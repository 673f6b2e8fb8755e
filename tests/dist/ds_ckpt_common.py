"""What the DeepSpeed fixture checkpoints were trained with (scripts/deepspeed_checkpoint_fixture.py): the model,
the config and each step's batches, shared by the fixture script (run under DeepSpeed) and the tests."""

from __future__ import annotations

import torch

from zerospeed.models import GPT
from zerospeed.models.gpt import GPTConfig

MICRO = 2
SEQ = 8


def micro_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=32, block_size=SEQ, n_layer=2, n_head=2, n_embd=8), seed=0)


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.1, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                         "warmup_num_steps": 4, "warmup_type": "linear"}},
            "zero_optimization": {"stage": stage}}


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank 0's and rank 1's micro-batch of optimizer step ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(2):
        seq = torch.randint(0, 32, (MICRO, SEQ + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out
