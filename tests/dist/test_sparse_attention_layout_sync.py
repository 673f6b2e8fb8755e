"""Random sparsity layouts drawn differently per rank are made equal to rank 0's on the first forward
(DeepSpeed broadcasts the master layout), so every rank computes the same attention."""

import random

import torch

from zerospeed.testing import run_distributed


def _rank() -> tuple[list[int], list[int]]:
    from zerospeed import comm
    from zerospeed.ops.sparse_attention import BigBirdSparsityConfig, SparseSelfAttention

    random.seed(100 + comm.get_rank())  # each rank draws its own random blocks
    attn = SparseSelfAttention(BigBirdSparsityConfig(num_heads=2, block=8, num_random_blocks=2), max_seq_length=128)
    drawn = attn.master_layout.flatten().tolist()
    q = torch.randn(1, 2, 64, 4)
    attn(q, q, q)
    return drawn, attn.master_layout.flatten().tolist()


def test_first_forward_broadcasts_rank0_layout() -> None:
    (drawn0, final0), (drawn1, final1) = run_distributed(_rank, 2, timeout=60)
    assert drawn0 != drawn1  # the ranks really drew different layouts
    assert final0 == drawn0 and final1 == drawn0
