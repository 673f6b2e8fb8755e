"""Activation checkpointing on the demo GPT: activation memory held for backward, peak RSS, step time.

    .venv/bin/python benchmarks/bench_activation_checkpointing.py [--preset demo] [--micro-batch 16] [--json]

Each transformer block's forward runs under ``zerospeed.checkpointing.checkpoint`` (non-reentrant,
RNG-exact). "held for backward" counts the bytes autograd keeps between forward and backward (saved
tensors, de-duplicated by storage) plus the inputs checkpoints hold; it is exact and independent of the
allocator. Peak RSS is the process high-water mark during forward+backward (reset before each run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from torch.autograd.graph import saved_tensors_hooks

from zerospeed import checkpointing
from zerospeed.models import PRESETS, GPT
from zerospeed.profiling.memory import MemoryTracker


def held_bytes_during_forward(model: GPT, x: torch.Tensor, y: torch.Tensor) -> tuple[int, torch.Tensor]:
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(x, y)
    return sum(storages.values()) + checkpointing.checkpointed_bytes(), loss


def run(preset: str, micro_batch: int, use_ckpt: bool, steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    cfg = PRESETS[preset]()
    model = GPT(cfg)
    if use_ckpt:
        for block in model.blocks if hasattr(model, "blocks") else model.transformer.h:
            block.forward = (lambda f: (lambda x: checkpointing.checkpoint(f, x)))(block.forward)
    x = torch.randint(0, 256, (micro_batch, cfg.block_size))
    y = torch.randint(0, 256, (micro_batch, cfg.block_size))
    tracker = MemoryTracker()
    held, loss = held_bytes_during_forward(model, x, y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    tracker.reset_peak()
    base = tracker.current_bytes()
    t0 = time.perf_counter()
    for _ in range(steps):
        _, loss = model(x, y)
        loss.backward()
        model.zero_grad(set_to_none=True)
    seconds = (time.perf_counter() - t0) / steps
    return {"checkpointing": use_ckpt, "held_MiB": held / 2**20, "peak_rss_over_base_MiB": (tracker.peak_bytes() - base) / 2**20,
            "s_per_step": seconds, "loss": float(loss.detach())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--only", choices=["on", "off"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.only:
        print(json.dumps(run(a.preset, a.micro_batch, a.only == "on", a.steps)))
        return
    # Each case in a fresh process, so one case's freed memory does not hide the other's peak.
    rows = []
    for case in ("off", "on"):
        out = subprocess.run([sys.executable, __file__, "--preset", a.preset, "--micro-batch", str(a.micro_batch),
                              "--steps", str(a.steps), "--only", case], check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if a.json:
        for r in rows:
            print(json.dumps({"bench": "activation_checkpointing", "preset": a.preset, **r}))
        return
    print(f"demo GPT preset={a.preset} micro_batch={a.micro_batch} (fp32, CPU)")
    print(f"{'checkpointing':<14}{'held for bwd MiB':>18}{'peak RSS +MiB':>15}{'s/step':>9}{'loss':>9}")
    for r in rows:
        print(f"{str(r['checkpointing']):<14}{r['held_MiB']:>18.1f}{r['peak_rss_over_base_MiB']:>15.1f}{r['s_per_step']:>9.3f}{r['loss']:>9.4f}")
    print(f"held-for-backward reduction: {rows[0]['held_MiB'] / max(rows[1]['held_MiB'], 1e-9):.1f}x; "
          f"losses equal: {rows[0]['loss'] == rows[1]['loss']}")


if __name__ == "__main__":
    main()
