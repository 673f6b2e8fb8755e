"""Lamb against a plain-Python reference of DeepSpeed FusedLamb's math (lists of floats, no torch)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from zerospeed.optim import Lamb


def reference_lamb(w, grads, *, lr, betas=(0.9, 0.999), eps=1e-8, wd=0.0, bias_correction=True,
                   eps_inside_sqrt=False, max_coeff=10.0, min_coeff=0.01):
    """Run LAMB on one tensor (a list of floats) over a list of gradients; return weights and ratios."""
    w = list(w)
    m = [0.0] * len(w)
    v = [0.0] * len(w)
    ratios = []
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
        c1 = 1 - b1**t if bias_correction else 1.0
        c2 = 1 - b2**t if bias_correction else 1.0
        u = []
        for wi, mi, vi in zip(w, m, v):
            denom = math.sqrt(vi / c2 + eps) if eps_inside_sqrt else math.sqrt(vi / c2) + eps
            u.append((mi / c1) / denom + wd * wi)
        w_norm = math.sqrt(sum(x * x for x in w))
        u_norm = math.sqrt(sum(x * x for x in u))
        r = 1.0 if w_norm == 0 or u_norm == 0 else min(max(w_norm / u_norm, min_coeff), max_coeff)
        ratios.append(r)
        w = [wi - lr * r * ui for wi, ui in zip(w, u)]
    return w, ratios


def run_lamb(w0, grads, **kw):
    p = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float64))
    opt = Lamb([p], **kw)
    ratios = []
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        ratios.append(opt.get_lamb_coeffs()[0])
    return p.detach().tolist(), ratios


W0 = [0.5, -1.0, 2.0, 0.25, -0.75]
GRADS = [[0.1, -0.2, 0.3, 0.05, -0.4], [0.2, 0.1, -0.3, 0.0, 0.4], [-0.1, 0.3, 0.2, -0.05, 0.1],
         [0.05, -0.05, 0.1, 0.2, -0.2]]


@pytest.mark.parametrize(
    "kw",
    [
        dict(lr=0.01),
        dict(lr=0.01, wd=0.1),
        dict(lr=0.05, wd=0.01, betas=(0.8, 0.99), eps=1e-6, eps_inside_sqrt=True),
        dict(lr=0.01, bias_correction=False),
        dict(lr=0.01, max_coeff=0.5),  # ratio clipped from above
        dict(lr=0.01, min_coeff=5.0, max_coeff=8.0),  # ratio clipped from below
    ],
)
def test_matches_reference(kw):
    ref_kw = dict(kw)
    lamb_kw = dict(kw)
    if "wd" in lamb_kw:
        lamb_kw["weight_decay"] = lamb_kw.pop("wd")
    w_ref, r_ref = reference_lamb(W0, GRADS, **ref_kw)
    w, r = run_lamb(W0, GRADS, **lamb_kw)
    assert w == pytest.approx(w_ref, rel=1e-12, abs=1e-14)
    assert r == pytest.approx(r_ref, rel=1e-12)


def test_clipping_actually_happens():
    _, r = reference_lamb(W0, GRADS, lr=0.01, max_coeff=0.5)
    assert all(x == 0.5 for x in r)
    _, r = reference_lamb(W0, GRADS, lr=0.01, min_coeff=5.0, max_coeff=8.0)
    assert all(5.0 <= x <= 8.0 for x in r)


def test_zero_weights_use_ratio_one():
    w, r = run_lamb([0.0, 0.0, 0.0], [[0.1, -0.2, 0.3]], lr=0.1)
    w_ref, r_ref = reference_lamb([0.0, 0.0, 0.0], [[0.1, -0.2, 0.3]], lr=0.1)
    assert r == [1.0] == r_ref and w == pytest.approx(w_ref)


def test_trust_ratio_per_tensor_and_groups():
    a = torch.nn.Parameter(torch.tensor(W0[:2], dtype=torch.float64))
    b = torch.nn.Parameter(torch.tensor(W0[2:], dtype=torch.float64))
    opt = Lamb([{"params": [a]}, {"params": [b], "lr": 0.1, "weight_decay": 0.2}], lr=0.01)
    for g in GRADS[:2]:
        a.grad = torch.tensor(g[:2], dtype=torch.float64)
        b.grad = torch.tensor(g[2:], dtype=torch.float64)
        opt.step()
    wa, _ = reference_lamb(W0[:2], [g[:2] for g in GRADS[:2]], lr=0.01)
    wb, _ = reference_lamb(W0[2:], [g[2:] for g in GRADS[:2]], lr=0.1, wd=0.2)
    assert a.detach().tolist() == pytest.approx(wa, rel=1e-12)
    assert b.detach().tolist() == pytest.approx(wb, rel=1e-12)
    assert len(opt.get_lamb_coeffs()) == 2


def test_state_dict_resume_is_exact():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 3))
    grads = [torch.randn(4, 3) for _ in range(4)]
    opt = Lamb([p], lr=0.01, weight_decay=0.01)
    for g in grads[:2]:
        p.grad = g.clone()
        opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = Lamb([q], lr=0.01, weight_decay=0.01)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a checkpoint file
    for g in grads[2:]:
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
    assert torch.equal(p, q)
    assert int(opt.state[p]["step"]) == 4


def test_skips_params_without_grad_and_rejects_bad_values():
    p = torch.nn.Parameter(torch.ones(2))
    Lamb([p]).step()
    assert torch.equal(p, torch.ones(2))
    with pytest.raises(ValueError, match="min_coeff"):
        Lamb([p], min_coeff=2.0, max_coeff=1.0)
    with pytest.raises(ValueError, match="betas"):
        Lamb([p], betas=(1.0, 0.9))
