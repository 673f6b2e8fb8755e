"""One-process simulation of top-k compressed Adam schemes on the demo GPT (2 ranks by splitting the batch).

    python benchmarks/sim_topk.py --scheme NAME [--steps 300] [--ratio 0.01] [--warmup 60] [--ramp N]

Schemes (``--warmup`` dense Adam steps first where the name says ``warm``):
  dense            Adam on the averaged gradient (the baseline)
  grad             top-k of error-compensated gradients, Adam on the averaged sparse gradient (the old compressor)
  grad-warm        the same after a dense warm-up
  frozen           after the warm-up Adam's variance is frozen; top-k of gradients by |acc|, momentum on the sum
  frozen-pre       the same, entries chosen by |acc| / sqrt(v) (Adam-preconditioned magnitude)
  mom-pre          after the warm-up: frozen variance, top-k of error-compensated local momentum (1-bit Adam's
                   shape), entries chosen by |x| / sqrt(v)
  mom              as mom-pre, entries chosen by |x|
  mom-union        as mom, but the ranks exchange their top-k indices and average their exact values at the
                   union of the indices (every selected entry exact; all ranks' residuals cleared there);
                   -vw suffix: entries ranked by |x| * (sqrt(v) + eps)
  upd(-union)      each rank keeps its own live variance of its local gradient and sends the top-k of its
                   error-compensated preconditioned momentum b1 * u + (1 - b1) * g / (sqrt(v_r) + eps); the
                   average u is the update (p -= lr * u), per-rank or exact at the union of the indices
  dgc              DGC's momentum correction with Adam's frozen variance: each rank keeps its own momentum
                   u = b1 u + (1-b1) g and accumulates it (acc += u); top-k of |acc| is averaged and applied as
                   p -= lr * avg / sqrt(v); sent entries are zeroed in acc and u (momentum factor masking)
  *-layer          (suffix) top-k per parameter tensor instead of over the whole model
  ramp             grad with DGC's density ramp: 4^(-t/15) until it reaches --ratio, dense never after
  ds               DeepSpeed's 1-bit Adam update without compression (no bias correction), all along
  ds-fbc           the same until --warmup, then the variance frozen and bias-corrected (1 - beta2^warmup)
  adam-fz          Adam until --warmup, then its variance frozen (bias-corrected), no compression
The learning rate warms up linearly over the first 60 steps for every scheme (bench_onebit's --warmup-frac 0.2).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from zerospeed.data import ByteDataset
from zerospeed.models import GPT, PRESETS

MICRO, LR, B1, B2, EPS, WORLD = 8, 1e-3, 0.9, 0.999, 1e-8, 2


def batch(data: ByteDataset, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    idx = torch.randint(len(data), (MICRO * WORLD,), generator=g)[rank * MICRO:(rank + 1) * MICRO].tolist()
    return torch.stack([data[i][0] for i in idx]), torch.stack([data[i][1] for i in idx])


def select(score: torch.Tensor, k: int, sizes: list[int] | None, ratio: float) -> torch.Tensor:
    """Indices of the top-k scores: over the whole vector, or per tensor (``sizes``) at ``ratio`` each."""
    if sizes is None:
        return torch.topk(score, k, sorted=False).indices
    out, at = [], 0
    for n in sizes:
        kk = max(1, math.ceil(ratio * n))
        out.append(torch.topk(score[at:at + n], kk, sorted=False).indices + at)
        at += n
    return torch.cat(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scheme", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--lr-warmup", type=int, default=60)
    p.add_argument("--ramp", type=int, default=0, help="after the warm-up, density falls geometrically from 1 "
                   "to --ratio over this many steps (mom schemes)")
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = PRESETS["demo"]()
    model = GPT(cfg, seed=0)
    data = ByteDataset(cfg.block_size, "train")
    params = [q for q in model.parameters() if q.requires_grad]
    flat = torch.nn.utils.parameters_to_vector(params).detach().clone()
    n = flat.numel()
    k = max(1, math.ceil(a.ratio * n))
    m, v = torch.zeros(n), torch.zeros(n)
    res = [torch.zeros(n) for _ in range(WORLD)]
    prec: torch.Tensor | None = None
    sizes = [q.numel() for q in params] if a.scheme.endswith("-layer") else None
    scheme = a.scheme.removesuffix("-layer")
    u = [torch.zeros(n) for _ in range(WORLD)]
    vr: list[torch.Tensor] | None = None
    upd = torch.zeros(n)
    warm = a.warmup if "warm" in a.scheme or a.scheme.startswith(("frozen", "mom", "adam", "dgc", "upd")) else 0
    losses = []
    for t in range(a.steps):
        lr = LR * min(1.0, t / a.lr_warmup) if a.lr_warmup else LR
        grads, loss = [], 0.0
        for r in range(WORLD):
            torch.nn.utils.vector_to_parameters(flat, params)
            model.zero_grad(set_to_none=True)
            x, y = batch(data, t, r)
            _, l = model(x, y)
            l.backward()
            grads.append(torch.cat([q.grad.reshape(-1) for q in params]))
            loss += float(l.detach()) / WORLD
        losses.append(loss)
        step = t + 1
        if scheme.startswith("ds"):
            g = sum(grads) / WORLD
            m.mul_(B1).add_(g, alpha=1 - B1)
            if a.scheme == "ds" or t < a.warmup:
                v.mul_(B2).addcmul_(g, g, value=1 - B2)
                flat.addcdiv_(m, v.sqrt() + EPS, value=-lr)
            else:
                flat.addcdiv_(m, (v / (1 - B2 ** a.warmup)).sqrt() + EPS, value=-lr)
            continue
        dense = scheme == "dense" or t < warm
        ratio = a.ratio
        if scheme == "ramp":
            ratio = max(a.ratio, 4.0 ** (-t / 15))
            dense = ratio >= 1.0
        if dense or scheme.startswith("grad") or scheme == "ramp":
            if dense:
                g = sum(grads) / WORLD
            else:
                g = torch.zeros(n)
                for r in range(WORLD):
                    acc = res[r].add_(grads[r])
                    idx = select(acc.abs(), max(1, math.ceil(ratio * n)), sizes, ratio)
                    g.index_add_(0, idx, acc[idx])
                    res[r].index_fill_(0, idx, 0.0)
                g /= WORLD
            m.mul_(B1).add_(g, alpha=1 - B1)
            v.mul_(B2).addcmul_(g, g, value=1 - B2)
            denom = (v / (1 - B2 ** step)).sqrt_().add_(EPS)
            flat.addcdiv_(m, denom, value=-lr / (1 - B1 ** step))
            continue
        if prec is None:  # freeze Adam's variance (bias-corrected) at the end of the warm-up
            prec = 1.0 / ((v / (1 - B2 ** (step - 1))).sqrt() + EPS)
        weight = prec if scheme.endswith("-pre") else 1.0 / prec if scheme.endswith("-vw") else torch.ones(n)
        if scheme == "dgc":
            total = torch.zeros(n)
            for r in range(WORLD):
                u[r].mul_(B1).add_(grads[r], alpha=1 - B1)
                acc = res[r].add_(u[r])
                idx = select(acc.abs(), k, sizes, a.ratio)
                total.index_add_(0, idx, acc[idx])
                acc.index_fill_(0, idx, 0.0)
                u[r].index_fill_(0, idx, 0.0)
            flat.add_(total / WORLD * prec, alpha=-lr)
        elif scheme == "adam-fz":
            g = sum(grads) / WORLD
            m.mul_(B1).add_(g, alpha=1 - B1)
            flat.add_(m * prec, alpha=-lr / (1 - B1 ** step))
        elif scheme.startswith("frozen"):
            g = torch.zeros(n)
            for r in range(WORLD):
                acc = res[r].add_(grads[r])
                idx = select(acc.abs() * weight, k, sizes, a.ratio)
                g.index_add_(0, idx, acc[idx])
                res[r].index_fill_(0, idx, 0.0)
            g /= WORLD
            m.mul_(B1).add_(g, alpha=1 - B1)
            flat.add_(m * prec, alpha=-lr / (1 - B1 ** step))
        elif scheme.startswith("upd"):
            if vr is None:  # from the warm-up: Adam's variance (each rank keeps its own copy live) and update
                vr = [v.clone() for _ in range(WORLD)]
                upd = m / ((v / (1 - B2 ** (step - 1))).sqrt() + EPS)
            xs = []
            for r in range(WORLD):
                vr[r].mul_(B2).addcmul_(grads[r], grads[r], value=1 - B2)
                den = (vr[r] / (1 - B2 ** step)).sqrt() + EPS
                xs.append(res[r].add_(upd * B1 + grads[r] / den * (1 - B1)))
            new = torch.zeros(n)
            if "union" in scheme:
                chosen = torch.zeros(n, dtype=torch.bool)
                for r in range(WORLD):
                    chosen[select(xs[r].abs(), k, sizes, a.ratio)] = True
                idx = chosen.nonzero().squeeze(1)
                for r in range(WORLD):
                    new.index_add_(0, idx, xs[r][idx])
                    res[r].index_fill_(0, idx, 0.0)
            else:
                for r in range(WORLD):
                    idx = select(xs[r].abs(), k, sizes, a.ratio)
                    new.index_add_(0, idx, xs[r][idx])
                    res[r].index_fill_(0, idx, 0.0)
            upd = new / WORLD
            flat.add_(upd, alpha=-lr)
        elif scheme.startswith("mom"):
            ratio = a.ratio
            if a.ramp and t - warm < a.ramp:
                ratio = a.ratio ** ((t - warm + 1) / a.ramp)
            kk = max(1, math.ceil(ratio * n))
            new = torch.zeros(n)
            xs = [res[r].add_(m * B1 + grads[r] * (1 - B1)) for r in range(WORLD)]
            if "union" in scheme:
                chosen = torch.zeros(n, dtype=torch.bool)
                for r in range(WORLD):
                    chosen[select(xs[r].abs() * weight, kk, sizes, ratio)] = True
                idx = chosen.nonzero().squeeze(1)
                for r in range(WORLD):
                    new.index_add_(0, idx, xs[r][idx])
                    res[r].index_fill_(0, idx, 0.0)
            else:
                for r in range(WORLD):
                    idx = select(xs[r].abs() * weight, kk, sizes, ratio)
                    new.index_add_(0, idx, xs[r][idx])
                    res[r].index_fill_(0, idx, 0.0)
            m = new / WORLD
            flat.add_(m * prec, alpha=-lr)
        else:
            raise SystemExit(f"unknown scheme {a.scheme}")
    tail = sum(losses[-20:]) / 20
    print(json.dumps({"scheme": a.scheme, "ratio": a.ratio, "warmup": warm, "ramp": a.ramp, "first": losses[0],
                      "last20": tail,
                      "at": {s: losses[s] for s in (59, 99, 199, a.steps - 1) if s < a.steps}}), flush=True)


if __name__ == "__main__":
    main()
