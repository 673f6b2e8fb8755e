"""Checkpoint figures: save / load seconds and bytes versus model size, async-save stall, to-fp32 memory.

For each size, an MLP of ``width x width`` layers trains one AdamW step at world 2 (ZeRO stage 2, fp32),
then: a synchronous save (wall seconds on the slowest rank, bytes on disk), a load into a fresh engine,
an async save (the stall: seconds ``save_checkpoint`` blocked the training thread; then the write time in
the background). ``to-fp32`` runs in a fresh interpreter (no ranks) and reports its peak RSS above the
interpreter's RSS after imports, next to the model's fp32 size.

    python benchmarks/bench_checkpoint.py [--sizes 1,4,16] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

from zerospeed.testing import run_distributed

torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # warm torch._dynamo before forking ranks
MiB = 1024 * 1024


def _model(million: int) -> nn.Module:
    width = 1000
    layers = max(1, round(million * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _rank(million: int, path: str) -> dict[str, float]:
    import zerospeed

    def build() -> Any:
        model = _model(million)
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
        engine, *_ = zerospeed.initialize(model=model, config=cfg)
        return engine

    engine = build()
    loss = engine(torch.randn(2, 1000)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    t0 = time.perf_counter()
    engine.save_checkpoint(path, tag="sync")
    save_s = time.perf_counter() - t0
    other = build()
    t0 = time.perf_counter()
    other.load_checkpoint(path, tag="sync")
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.save_checkpoint(path, tag="async", async_save=True)
    stall_s = time.perf_counter() - t0
    engine.wait_for_checkpoint()
    async_total_s = time.perf_counter() - t0
    return {"save_s": save_s, "load_s": load_s, "stall_s": stall_s, "async_total_s": async_total_s}


_TO_FP32 = """
import json, resource, sys, time, psutil
from zerospeed.runtime.checkpoint import consolidate
base = psutil.Process().memory_info().rss
t0 = time.perf_counter()
consolidate(sys.argv[1], sys.argv[2], tag="sync")
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"to_fp32_s": seconds, "to_fp32_peak_above_base_mib": (peak - base) / 2**20}))
"""


def measure(million: int) -> dict[str, Any]:
    path = tempfile.mkdtemp(prefix="zs-bench-ckpt-")
    try:
        ranks = run_distributed(_rank, 2, million, path, timeout=600)
        row: dict[str, Any] = {k: max(r[k] for r in ranks) for k in ranks[0]}
        params = sum(p.numel() for p in _model(million).parameters())
        ckpt = os.path.join(path, "sync")
        row["bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
        row.update(params=params, model_fp32_mib=params * 4 / MiB)
        out = subprocess.run([sys.executable, "-c", _TO_FP32, path, os.path.join(path, "model.safetensors")],
                             capture_output=True, text=True, check=True)
        row.update(json.loads(out.stdout.strip().splitlines()[-1]))
        return row
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,16", help="model sizes in millions of parameters")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [measure(int(s)) for s in args.sizes.split(",")]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"{'params':>10} {'fp32 MiB':>9} {'ckpt MiB':>9} {'save s':>7} {'load s':>7} {'stall s':>8} "
          f"{'async s':>8} {'to-fp32 s':>9} {'to-fp32 peak MiB':>16}")
    for r in rows:
        print(f"{r['params']:>10} {r['model_fp32_mib']:>9.1f} {r['bytes'] / MiB:>9.1f} {r['save_s']:>7.3f} "
              f"{r['load_s']:>7.3f} {r['stall_s']:>8.3f} {r['async_total_s']:>8.3f} {r['to_fp32_s']:>9.3f} "
              f"{r['to_fp32_peak_above_base_mib']:>16.1f}")


if __name__ == "__main__":
    main()
