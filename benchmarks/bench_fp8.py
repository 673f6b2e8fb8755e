"""FP8 linears vs the same run without them: step time, peak memory and loss, through the engine.

    .venv/bin/python benchmarks/bench_fp8.py                         # CUDA (FP8 tensor cores): native
    .venv/bin/python benchmarks/bench_fp8.py --device cpu --preset demo --backend emulated --steps 6

World size 1. On a GPU both contenders train in bf16 (the fp8 one with its linears' matmuls in FP8, via
torch._scaled_mm); on CPU both train in fp32 and the fp8 contender runs the emulation (a correctness run:
FP8 buys nothing on a CPU). Losses after the same steps show the accuracy cost. Run by ``scripts/gpu-check``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from zerospeed.models import GPT, PRESETS, GPTConfig
from zerospeed.testing import run_distributed

SIZES = {"350m": lambda: GPTConfig(block_size=1024, n_layer=24, n_head=16, n_embd=1024, vocab_size=50304)}


def _config(name: str) -> GPTConfig:
    return SIZES[name]() if name in SIZES else PRESETS[name]()


def run(preset: str, fp8: dict, micro: int, steps: int, warmup: int, device: str) -> dict:
    import zerospeed

    cuda = device == "cuda"
    cfg = _config(preset)
    model = GPT(cfg, seed=0)
    config = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "bf16": {"enabled": cuda},
              "zero_optimization": {"stage": 1}, "fp8": fp8}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (micro, cfg.block_size + 1), generator=g) for _ in range(steps)]
    loss = 0.0
    for i, b in enumerate(batches):
        if i == warmup:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
        b = b.to(engine.device)
        _, out = engine(b[:, :-1], b[:, 1:])
        engine.backward(out)
        engine.step()
        loss = float(out.detach())
    if cuda:
        torch.cuda.synchronize()
    s = (time.perf_counter() - t0) / (steps - warmup)
    return {"fp8": bool(fp8.get("enabled")), "modules": len(engine.fp8_modules), "s_per_step": s,
            "tokens_per_s": micro * cfg.block_size / s, "loss": loss,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="350m", choices=sorted([*PRESETS, *SIZES]))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backend", default="auto", choices=["auto", "native", "emulated", "torchao"])
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_fp8: no CUDA device here; nothing to measure (try --device cpu --backend emulated)")
        return 0
    backend = "nccl" if a.device == "cuda" else "gloo"
    rows = []
    for fp8 in ({}, {"enabled": True, "backend": a.backend}):
        rows += run_distributed(run, 1, a.preset, fp8, a.micro_batch, a.steps, min(a.warmup, a.steps - 1), a.device,
                                backend=backend, timeout=600)
    where = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    print(f"{where}, GPT {a.preset}, micro-batch {a.micro_batch}, {a.steps - a.warmup} timed steps, world 1, "
          f"{'bf16' if a.device == 'cuda' else 'fp32'} (+ fp8 backend {a.backend})")
    print(f"{'contender':<26}{'s/step':>9}{'speed-up':>10}{'tokens/s':>12}{'peak MiB':>10}{'loss':>11}")
    for r in rows:
        name = f"fp8 linears ({r['modules']})" if r["fp8"] else "no fp8"
        print(f"{name:<26}{r['s_per_step']:>9.4f}{rows[0]['s_per_step'] / r['s_per_step']:>10.2f}"
              f"{r['tokens_per_s']:>12,.0f}{r['peak_mib']:>10.0f}{r['loss']:>11.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
