"""On one CUDA device: zerospeed ZeRO stages 0-3 vs a plain PyTorch loop, same GPT, same data.

    .venv/bin/python benchmarks/bench_gpu.py [--preset bench] [--dtype bf16] [--steps 20] [--json]

World size 1 (NCCL), so the figures measure the engine's own overhead on the device (hooks, buckets,
master copies, the optimizer) and its memory: seconds/step, tokens/s, peak device memory, MFU against the
device's known peak. Run by ``scripts/gpu-check``; exits with a message where no CUDA device is present.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from zerospeed.models import GPT, PRESETS
from zerospeed.profiling.flops_profiler import get_model_profile
from zerospeed.profiling.flops_profiler.peaks import mfu
from zerospeed.testing import run_distributed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _batches(preset: str, micro: int, steps: int) -> list[torch.Tensor]:
    cfg = PRESETS[preset]()
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, cfg.vocab_size, (micro, cfg.block_size + 1), generator=g) for _ in range(steps)]


def _measure(step_fn, batches: list[torch.Tensor], warmup: int) -> tuple[float, float]:
    losses = []
    for i, b in enumerate(batches):
        if i == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
        losses.append(step_fn(b.cuda()))
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (len(batches) - warmup), losses[-1]


def plain(preset: str, dtype: str, micro: int, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    model = GPT(PRESETS[preset]()).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(b: torch.Tensor) -> float:
        with torch.autocast("cuda", dtype=DTYPES[dtype], enabled=dtype != "fp32"):
            _, loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    s, loss = _measure(step, _batches(preset, micro, steps), warmup)
    return {"contender": f"torch ({dtype} autocast)", "s_per_step": s, "loss": loss,
            "peak_mem_mib": torch.cuda.max_memory_allocated() / 2**20}


def zerospeed_run(stage: int, preset: str, dtype: str, micro: int, steps: int, warmup: int) -> dict:
    import zerospeed

    torch.manual_seed(0)
    model = GPT(PRESETS[preset]())
    config = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "bf16": {"enabled": dtype == "bf16"}, "zero_optimization": {"stage": stage}}
    engine, *_ = zerospeed.initialize(model=model, config=config)

    def step(b: torch.Tensor) -> float:
        _, loss = engine(b[:, :-1], b[:, 1:])
        engine.backward(loss)
        engine.step()
        return float(loss)

    s, loss = _measure(step, _batches(preset, micro, steps), warmup)
    return {"contender": f"zerospeed stage {stage} ({dtype})", "s_per_step": s, "loss": loss,
            "peak_mem_mib": torch.cuda.max_memory_allocated() / 2**20,
            "model_state_mib": engine.memory_breakdown()["model_states"] / 2**20}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="bench", choices=sorted(PRESETS))
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing to measure")
        return 0
    cfg = PRESETS[a.preset]()
    tokens = a.micro_batch * cfg.block_size
    x = torch.zeros(a.micro_batch, cfg.block_size, dtype=torch.long)
    fwd_flops, _, _ = get_model_profile(GPT(cfg), args=[x, x], print_profile=False, as_string=False, warm_up=0)
    rows = [run_distributed(plain, 1, a.preset, a.dtype, a.micro_batch, a.steps, a.warmup, backend="nccl",
                            timeout=600)[0]]
    for stage in (0, 1, 2, 3):
        rows += run_distributed(zerospeed_run, 1, stage, a.preset, a.dtype, a.micro_batch, a.steps, a.warmup,
                                backend="nccl", timeout=600)
    name = torch.cuda.get_device_name(0)
    base = rows[0]["s_per_step"]
    for r in rows:
        achieved = 3 * fwd_flops / r["s_per_step"]
        util = mfu(achieved, name)
        r.update({"tokens_per_s": tokens / r["s_per_step"], "vs_torch": r["s_per_step"] / base,
                  "mfu": util, "device": name, "preset": a.preset})
        if a.json:
            print(json.dumps(r))
    if not a.json:
        print(f"{name}, GPT preset={a.preset}, micro-batch {a.micro_batch}, seq {cfg.block_size}, world 1")
        print(f"{'contender':<28}{'s/step':>9}{'vs torch':>10}{'tokens/s':>12}{'peak MiB':>10}{'MFU':>8}{'loss':>9}")
        for r in rows:
            m = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "n/a"
            print(f"{r['contender']:<28}{r['s_per_step']:>9.4f}{r['vs_torch']:>10.2f}{r['tokens_per_s']:>12,.0f}"
                  f"{r['peak_mem_mib']:>10.0f}{m:>8}{r['loss']:>9.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
