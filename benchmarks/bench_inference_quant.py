"""Weight-only INT8 / INT4 on a briefly trained GPT: bytes of the linear weights and perplexity vs fp32.

    .venv/bin/python benchmarks/bench_inference_quant.py [--preset demo] [--steps 300] [--json]

Trains the preset GPT on the bundled corpus for ``--steps`` AdamW steps (fp32, one process), then measures
validation perplexity (``--windows`` windows of ``block_size`` bytes) for fp32, INT8 symmetric per-channel
and INT4 asymmetric with ``--int4-group`` columns per group, all through ``zerospeed.init_inference``.
Bytes are *measured* from the tensors the model holds (codes + scales + offsets for quantized layers).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time

import torch

import zerospeed
from zerospeed.data import ByteDataset
from zerospeed.inference.quantization import model_bytes
from zerospeed.models import PRESETS, GPT


def train(model: GPT, steps: int, batch: int) -> GPT:
    data = ByteDataset(model.config.block_size, "train")
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _ in range(steps):
        idx = torch.randint(len(data), (batch,), generator=g).tolist()
        x, y = (torch.stack(t) for t in zip(*(data[i] for i in idx)))
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
    return model.eval()


@torch.no_grad()
def perplexity(model: torch.nn.Module, block: int, windows: int) -> float:
    data = ByteDataset(block, "val")
    losses = []
    for start in range(0, windows, 16):
        x, y = (torch.stack(t) for t in zip(*(data[i] for i in range(start, min(windows, start + 16)))))
        losses.append(model(x, y)[1].item() * len(x))
    return math.exp(sum(losses) / windows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--windows", type=int, default=128)
    ap.add_argument("--int4-group", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = PRESETS[args.preset]()
    t0 = time.time()
    base = train(GPT(cfg, seed=0), args.steps, args.batch)
    train_s = time.time() - t0
    fp32_linear = model_bytes(base, linear_weights_only=True)
    fp32_all = model_bytes(base)
    ppl32 = perplexity(base, cfg.block_size, args.windows)
    rows = [{"variant": "fp32", "linear_bytes": fp32_linear, "linear_ratio": 1.0, "model_ratio": 1.0,
             "ppl": ppl32, "ppl_rise": 0.0}]
    quants = {"int8 sym per-channel": {"num_bits": 8, "q_type": "symmetric", "q_groups": 1},
              f"int4 asym group {args.int4_group}": {"num_bits": 4, "q_type": "asymmetric",
                                                     "q_groups": cfg.n_embd // args.int4_group}}
    for name, q in quants.items():
        eng = zerospeed.init_inference(copy.deepcopy(base), dtype="fp32", quant={"weight": q})
        lb = model_bytes(eng.module, linear_weights_only=True)
        ppl = perplexity(eng.module, cfg.block_size, args.windows)
        rows.append({"variant": name, "linear_bytes": lb, "linear_ratio": lb / fp32_linear,
                     "model_ratio": model_bytes(eng.module) / fp32_all, "ppl": ppl, "ppl_rise": ppl / ppl32 - 1})
    print(f"# preset={args.preset} params={base.num_params()} steps={args.steps} train_s={train_s:.0f} "
          f"windows={args.windows}x{cfg.block_size}")
    for r in rows:
        if args.json:
            print(json.dumps({"preset": args.preset, **r}))
        else:
            print(f"{r['variant']:<24} linear weights {r['linear_bytes']:>9} B ({r['linear_ratio']:.4f}x)  "
                  f"whole model {r['model_ratio']:.4f}x  perplexity {r['ppl']:.4f} ({100 * r['ppl_rise']:+.2f} %)")


if __name__ == "__main__":
    main()
