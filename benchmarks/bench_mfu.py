"""Model FLOPs utilization of a ~1B-parameter GPT on one CUDA device: plain PyTorch and zerospeed, bf16.

    .venv/bin/python benchmarks/bench_mfu.py [--layers 20] [--micro-batch 8] [--steps 10] [--compile]

The model is ``zerospeed.models.GPT`` at width 2048, 16 heads, ``--layers`` 20, vocabulary 50304, seq 2048:
1.11B parameters. Model FLOPs per step (PaLM's count, as nanoGPT's ``estimate_mfu``): ``6·N·T`` for the
matrix multiplies of forward and backward, with N the parameters without the position table (the tied LM head
counts: it multiplies), plus the attention scores and their use, ``12·L·d·s·T`` (not halved for the causal
mask), for T tokens per step. Achieved TFLOP/s = model FLOPs / median step time; MFU = that over the device's
dense bf16 peak (H200: 989 TFLOP/s, ``zerospeed.profiling.flops_profiler.peaks``). Goal (issue 21): ≥ 45 %.

Contenders, each in its own process (world 1, NCCL): ``torch`` (bf16 autocast, fused AdamW) and zerospeed
stage 0 with ``bf16`` enabled (bf16 weights, fp32 master and Adam). ``--compile`` compiles each
transformer block in place (``Module.compile``) first, for both contenders. Without CUDA it prints why
and exits 0, so CI is unaffected.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # count devices without initialising CUDA (fork)

import torch  # noqa: E402

from zerospeed.models import GPT, GPTConfig  # noqa: E402
from zerospeed.profiling.flops_profiler.peaks import peak_flops  # noqa: E402
from zerospeed.testing import run_distributed  # noqa: E402


def config(layers: int) -> GPTConfig:
    return GPTConfig(vocab_size=50304, block_size=2048, n_layer=layers, n_head=16, n_embd=2048)


def model_flops_per_step(cfg: GPTConfig, n_params: int, tokens: int) -> float:
    """6·N·T + 12·L·d·s·T (N without the position table)."""
    n = n_params - cfg.block_size * cfg.n_embd
    return 6.0 * n * tokens + 12.0 * cfg.n_layer * cfg.n_embd * cfg.block_size * tokens


def _time(step: Any, batches: list[torch.Tensor], warmup: int) -> tuple[list[float], float]:
    times, loss = [], 0.0
    for i, b in enumerate(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(b)  # returns a float: synchronises
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, loss


def run(kind: str, layers: int, micro: int, steps: int, warmup: int, compile_: bool) -> dict[str, Any]:
    """One contender inside its rank: median step seconds, last loss, peak device memory."""
    cfg = config(layers)
    model = GPT(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (micro, cfg.block_size + 1), generator=g).cuda()
               for _ in range(warmup + steps)]
    if compile_:  # each block compiled in place: the engine's hooks stay on the modules
        for block in model.blocks:
            block.compile()
    if kind == "torch":
        model = model.cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step(b: torch.Tensor) -> float:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(b[:, :-1], b[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss)
    else:
        import zerospeed

        cfg_ds = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9, "gradient_clipping": 1.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                  "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}
        engine, *_ = zerospeed.initialize(model=model, config=cfg_ds)

        def step(b: torch.Tensor) -> float:
            _, loss = engine(b[:, :-1], b[:, 1:])
            engine.backward(loss)
            engine.step()
            return float(loss)
    times, loss = _time(step, batches, warmup)
    return {"contender": kind + (" + compile" if compile_ else ""), "s": statistics.median(times), "loss": loss,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile the model (both contenders)")
    p.add_argument("--contenders", nargs="+", choices=["torch", "zerospeed"], default=["torch", "zerospeed"])
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_mfu: no CUDA device here; nothing to measure")
        return 0
    cfg = config(a.layers)
    n_params = _count(cfg)
    tokens = a.micro_batch * cfg.block_size
    flops = model_flops_per_step(cfg, n_params, tokens)
    rows = []
    for kind in a.contenders:
        rows += run_distributed(run, 1, kind, a.layers, a.micro_batch, a.steps, a.warmup, a.compile,
                                backend="nccl", timeout=900)
    name = torch.cuda.get_device_name(0)
    peak = peak_flops(name)
    print(f"{name}: GPT {n_params / 1e9:.2f}B parameters ({cfg.n_layer} layers, width {cfg.n_embd}, seq "
          f"{cfg.block_size}), micro-batch {a.micro_batch} = {tokens} tokens/step, bf16, model FLOPs/step "
          f"{flops / 1e12:.1f} T; peak {'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}")
    print("| contender | s/step | tokens/s | TFLOP/s | MFU | peak device GiB | loss |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        achieved = flops / r["s"]
        mfu = "n/a" if peak is None else f"{100 * achieved / peak:.1f} %"
        print(f"| {r['contender']} | {r['s']:.3f} | {tokens / r['s']:,.0f} | {achieved / 1e12:.0f} | {mfu} | "
              f"{r['peak_mib'] / 1024:.1f} | {r['loss']:.3f} |")
    return 0


def _count(cfg: GPTConfig) -> int:
    """Parameters of ``GPT(cfg)`` (tied head counted once), from the shapes alone."""
    d, L = cfg.n_embd, cfg.n_layer
    per_block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return cfg.vocab_size * d + cfg.block_size * d + L * per_block + 2 * d


if __name__ == "__main__":
    sys.exit(main())
