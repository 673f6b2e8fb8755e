"""``Float8Linear``: an ``nn.Linear`` whose forward and both backward matmuls run in FP8.

forward  ``y  = x @ W.T``  with x, W in e4m3;
backward ``dx = dy @ W``   with dy in e5m2, W in e4m3;
         ``dW = dy.T @ x`` with dy in e5m2, x in e4m3;
each tensor quantised with its own dynamic scale (``scaling.to_fp8``), products accumulated in fp32 and
returned in the input's dtype; the bias is added in that dtype. ``native`` multiplies with
``torch._scaled_mm``; ``emulated`` multiplies the dequantised codes in fp32, which is the same arithmetic
up to summation order. Converting swaps the class of an existing module, so its parameters (and ZeRO-3's
hooks and shards) stay the same objects.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .scaling import E4M3, E5M2, from_fp8, to_fp8


def _mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, native: bool,
        out_dtype: torch.dtype) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale)`` for FP8 codes ``a`` [M, K] and ``b`` [K, N]."""
    if native:  # _scaled_mm wants a row-major, b column-major, and the inner size a multiple of 16
        pad = -a.shape[1] % 16
        if pad:  # e.g. dW's inner size is the token count: zero codes add nothing to the products
            a = torch.cat([a, a.new_zeros(a.shape[0], pad)], dim=1)
            b = torch.cat([b, b.new_zeros(pad, b.shape[1])], dim=0)
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=a_inv, scale_b=b_inv,
                                out_dtype=out_dtype)
    return (from_fp8(a, a_inv) @ from_fp8(b, b_inv)).to(out_dtype)


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, native: bool) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xq, x_inv = to_fp8(x2, E4M3)
        wq, w_inv = to_fp8(weight, E4M3)
        ctx.save_for_backward(xq, x_inv, wq, w_inv)
        ctx.native, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = native, x.shape, x.dtype, weight.dtype
        y = _mm(xq, x_inv, wq.t(), w_inv, native, torch.float32)
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        gq, g_inv = to_fp8(dy2, E5M2)
        dx = _mm(gq, g_inv, wq, w_inv, ctx.native, torch.float32).to(ctx.x_dtype).reshape(ctx.x_shape)
        dw = _mm(gq.t(), g_inv, xq, x_inv, ctx.native, torch.float32).to(ctx.w_dtype)
        return dx, dw, None


class Float8Linear(nn.Linear):
    """A linear layer computing in FP8 (see the module docstring); ``fp8_native`` picks ``_scaled_mm``."""

    fp8_native: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Fp8Matmul.apply(x, self.weight, self.fp8_native)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={'native' if self.fp8_native else 'emulated'}"


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The forward of ``Float8Linear`` written out (quantise, dequantise, ``F.linear``): for tests."""
    xq, x_inv = to_fp8(x.reshape(-1, x.shape[-1]), E4M3)
    wq, w_inv = to_fp8(weight, E4M3)
    y = F.linear(from_fp8(xq, x_inv), from_fp8(wq, w_inv)).to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(y.dtype)
