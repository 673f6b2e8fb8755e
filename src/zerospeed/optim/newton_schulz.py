"""Newton-Schulz orthogonalisation: the step that turns Muon's momentum into an (almost) orthogonal update.

For a matrix ``G = U S V^T`` the iteration returns ``U f(S) V^T``: ``X = G / (||G||_F + 1e-7)`` (so every
singular value is at most 1), then five times ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` and Keller
Jordan's quintic coefficients ``(a, b, c) = (3.4445, -4.7750, 2.0315)``; each singular value follows the scalar
map ``s <- a s + b s^3 + c s^5``, which pushes it into roughly ``[0.7, 1.2]``. The iteration runs on the wide
orientation (a tall matrix is transposed first, and back after).

``gram`` (DeepSpeed's default ``ns_method``) computes the same thing on the small square Gram matrix
``R = X X^T`` instead of ``X``, restarting from ``X`` at iteration 2 (Tri Dao's Gram Newton-Schulz): fewer
FLOPs when the matrix is far from square. DeepSpeed runs ``gram`` in fp16 and ``standard`` in bf16 on an
accelerator; zerospeed does the same on CUDA and uses fp32 on the CPU (bf16/fp16 matmuls are far slower than
fp32 on CPUs without native support, and fp32 keeps the CPU results exact enough for parity tests).
"""

from __future__ import annotations

import math

import torch

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_METHODS = ("gram", "standard")
_RESTART_AT = 2


def compute_dtype(method: str, device: torch.device) -> torch.dtype:
    """The dtype the iteration runs in: DeepSpeed's half types on CUDA, fp32 elsewhere."""
    if device.type != "cuda":
        return torch.float32
    return torch.float16 if method == "gram" else torch.bfloat16


def aspect_ratio_scale(rows: int, cols: int) -> float:
    """``sqrt(max(1, rows / cols))``: DeepSpeed's scale, so tall matrices get updates of comparable RMS."""
    return math.sqrt(rows / cols) if rows > cols else 1.0


def _normalised(g: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """Wide orientation, Frobenius-normalised, cast to ``dtype`` (normalised first: fp16 would overflow)."""
    tall = g.size(-2) > g.size(-1)
    x = g.float() if g.dtype == torch.float16 else g
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    return x.to(dtype), tall


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The standard quintic iteration on ``g`` (``[..., m, n]``), returned in ``dtype`` (default: fp32 on CPU)."""
    if g.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix (or a batch of them), got shape {tuple(g.shape)}")
    a, b, c = COEFFICIENTS
    x, tall = _normalised(g, dtype or compute_dtype("standard", g.device))
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x.mT if tall else x


def gram_newton_schulz(g: torch.Tensor, steps: int = NS_STEPS, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The same map as :func:`newton_schulz`, iterated on the Gram matrix ``R = X X^T`` (square: standard).

    The accumulated left factor ``Q`` satisfies ``X_k = Q X_0``; ``R`` follows ``R <- (aI + Z) R (aI + Z)``
    with ``Z = bR + cR^2``. At iteration 2 ``X`` is rebuilt as ``Q X`` and ``R`` recomputed (keeps half
    precision stable).
    """
    if g.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix (or a batch of them), got shape {tuple(g.shape)}")
    x, tall = _normalised(g, dtype or compute_dtype("gram", g.device))
    n, m = x.size(-2), x.size(-1)
    if m <= n:  # square: no saving, standard iteration
        a, b, c = COEFFICIENTS
        for _ in range(steps):
            s = x @ x.mT
            x = a * x + (b * s + c * s @ s) @ x
        return x.mT if tall else x
    a, b, c = COEFFICIENTS
    r = x @ x.mT
    q: torch.Tensor | None = None
    for i in range(steps):
        if i == _RESTART_AT and q is not None:
            x = q @ x
            r = x @ x.mT
            q = None
        z = b * r + c * r @ r
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = a * q + z @ q
        if i < steps - 1 and i + 1 != _RESTART_AT:
            rz = a * r + z @ r
            r = a * rz + z @ rz
    assert q is not None
    return x.mT @ q.mT if tall else q @ x


def orthogonalize(update: torch.Tensor, method: str = "gram", steps: int = NS_STEPS) -> torch.Tensor:
    """Muon's whole-matrix step on one parameter's update: NS (a conv filter viewed as ``[out, -1]``), times
    :func:`aspect_ratio_scale` of the last two dims (as DeepSpeed), in the update's dtype and shape."""
    if method not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {NS_METHODS}, got {method!r}")
    if update.ndim < 2:
        raise ValueError(f"Muon updates matrices (ndim >= 2), got a parameter of shape {tuple(update.shape)}; "
                         "give it to the auxiliary Adam (use_muon = False)")
    mat = update.reshape(update.size(0), -1) if update.ndim > 2 else update
    fn = gram_newton_schulz if method == "gram" else newton_schulz
    out = fn(mat, steps) * aspect_ratio_scale(update.size(-2), update.size(-1))
    return out.to(update.dtype).reshape(update.shape)
