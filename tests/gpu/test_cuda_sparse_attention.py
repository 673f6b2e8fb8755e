"""SparseSelfAttention on CUDA equals masked dense attention (fp64 exactly, fp16/bf16 loosely)."""

import pytest
import torch

from zerospeed.ops.sparse_attention import BigBirdSparsityConfig, FixedSparsityConfig, SparseSelfAttention
from zerospeed.sparse_attention import dense_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("cfg", [FixedSparsityConfig(4, 32, attention="unidirectional"),
                                 BigBirdSparsityConfig(4, 32, num_random_blocks=2, seed=0)],
                         ids=["fixed", "bigbird"])
def test_cuda_sparse_attention_matches_dense(cfg) -> None:
    dev = torch.device("cuda")
    attn = SparseSelfAttention(cfg, max_seq_length=1024).to(dev)
    q, k, v = (torch.randn(2, 4, 512, 64, device=dev, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kp = torch.zeros(2, 512, device=dev, dtype=torch.float64)
    kp[1, 400:] = -1e4
    out = attn(q, k, v, key_padding_mask=kp)
    ref = dense_reference(q, k, v, attn.get_layout(512), 32, 64 ** -0.5, key_padding_mask=kp)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-8)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    for dtype in (torch.float16, torch.bfloat16):
        low = attn(q.detach().to(dtype), k.detach().to(dtype), v.detach().to(dtype), key_padding_mask=kp)
        assert low.dtype == dtype
        torch.testing.assert_close(low.double(), ref.detach(), rtol=0.05, atol=0.05)
