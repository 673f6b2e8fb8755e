"""Benchmark 1 of ZeRO-Offload: CPU Adam(W) throughput (parameters per second) on N parameters.

Contenders, same data, same machine, same run:
  zerospeed flat      the offload kernel: one flat fp32 partition stepped by torch's fused CPU AdamW kernel
  torch fused         torch.optim.AdamW(fused=True) over the model's tensors
  torch foreach       torch.optim.AdamW(foreach=True) over the model's tensors
  torch single        torch.optim.AdamW(foreach=False)
  own multi-op        our own vectorised version (8 torch ops over the flat tensor): measured, then rejected
  DeepSpeedCPUAdam    when deepspeed is importable (its JIT-built AVX kernel)
Reported: median wall seconds per step, CPU seconds per step (all threads), parameters per second.

    python benchmarks/bench_cpu_adam.py [--params 100_000_000] [--tensors 100] [--steps 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable

import torch

from zerospeed.offload import adam_step_flat

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def _own_multi_op(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int) -> None:
    bc1, bc2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
    p.mul_(1 - LR * WD)
    m.lerp_(g, 1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
    denom = v.sqrt().div_(math.sqrt(bc2)).add_(EPS)
    p.addcdiv_(m, denom, value=-LR / bc1)


def contenders(n: int, tensors: int) -> dict[str, Callable[[], Callable[[], None]]]:
    """Name -> a builder that allocates the state and returns one step."""
    def flat() -> Callable[[], None]:
        p, g, m, v, step = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n), torch.zeros(())
        return lambda: adam_step_flat(p, g, m, v, step, LR, BETAS, EPS, WD, adamw_mode=True)

    def torch_opt(**kw: bool) -> Callable[[], Callable[[], None]]:
        def build() -> Callable[[], None]:
            params = [torch.nn.Parameter(torch.randn(n // tensors)) for _ in range(tensors)]
            for p in params:
                p.grad = torch.randn_like(p)
            opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
            return opt.step
        return build

    def own() -> Callable[[], None]:
        p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
        count = [0]

        def step() -> None:
            count[0] += 1
            _own_multi_op(p, g, m, v, count[0])
        return step

    out: dict[str, Callable[[], Callable[[], None]]] = {
        "zerospeed flat (fused kernel)": flat, "torch AdamW fused": torch_opt(fused=True),
        "torch AdamW foreach": torch_opt(foreach=True), "torch AdamW single-tensor": torch_opt(foreach=False),
        "own multi-op (rejected)": own}
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]

        def ds() -> Callable[[], None]:
            params = [torch.nn.Parameter(torch.randn(n // tensors)) for _ in range(tensors)]
            for p in params:
                p.grad = torch.randn_like(p)
            return DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD).step
        out["DeepSpeedCPUAdam"] = ds
    except Exception:  # noqa: BLE001 - not installed, or its JIT build failed
        pass
    return out


def measure(step: Callable[[], None], warmup: int, steps: int) -> tuple[float, float]:
    for _ in range(warmup):
        step()
    walls, cpus = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--tensors", type=int, default=100, help="tensors the torch optimizers see (a model's)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for name, build in contenders(args.params, args.tensors).items():
        step = build()
        wall, cpu = measure(step, args.warmup, args.steps)
        del step
        rows.append({"contender": name, "params": args.params, "wall_s": wall, "cpu_s": cpu,
                     "params_per_s": args.params / wall, "threads": torch.get_num_threads()})
    base = next(r for r in rows if r["contender"] == "torch AdamW foreach")["params_per_s"]
    if args.json:
        for r in rows:
            print(json.dumps({**r, "vs_foreach": r["params_per_s"] / base}))
        return
    print(f"CPU AdamW step on {args.params / 1e6:.0f}M fp32 parameters, {torch.get_num_threads()} threads")
    print(f"{'contender':<32}{'wall s':>9}{'cpu s':>9}{'Mparams/s':>11}{'vs foreach':>12}")
    for r in rows:
        print(f"{r['contender']:<32}{r['wall_s']:>9.3f}{r['cpu_s']:>9.3f}{r['params_per_s'] / 1e6:>11.0f}"
              f"{r['params_per_s'] / base:>12.2f}")
    if not any(r["contender"] == "DeepSpeedCPUAdam" for r in rows):
        print("DeepSpeedCPUAdam: not importable here (deepspeed not installed)")


if __name__ == "__main__":
    main()
