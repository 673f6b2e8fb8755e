"""Peers side by side: torch DDP, FSDP2, DeepSpeed and zerospeed ZeRO 0-3 on the same GPT (issue 21).

    PYTHONPATH=src DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python benchmarks/bench_peers.py --quick
    PYTHONPATH=src DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python benchmarks/bench_peers.py --write docs/benchmarks.md
    .venv/bin/python benchmarks/bench_peers.py --device cuda --dtype bf16 --quick     # scripts/gpu-check

Any Python whose ``import deepspeed`` works adds DeepSpeed 0.19.8's stages 0-3 (CPU, fp32, Gloo only); without
it those rows print why they were skipped. Two sizes of ``zerospeed.models.GPT``: ``mid`` (≈27M parameters,
seq 256) and ``gpt2-small`` (GPT-2 small's shape, 124M: 12 layers, width 768, 12 heads, vocabulary 50257,
seq 512), micro-batch 4, world 2. Two parts per size, each its own interleaved run with DDP as baseline:

* ``gas1``: one micro-batch per step; every contender (DDP, FSDP2 with and without resharding, DeepSpeed
  stages 0-3, zerospeed stages 0-3 and stage 2 with CPU offload);
* ``gas2``: ``gradient_accumulation_steps`` 2 (DDP skips the first micro-batch's all-reduce with ``no_sync``);
  DDP, FSDP2 (no reshard), DeepSpeed stage 2, zerospeed stage 2 as DeepSpeed does it (reduce-scatter every
  micro-batch) and with ``zero_local_grad_accumulation`` (one reduce-scatter per step).

Reported per contender (``harness.py``): median wall and CPU seconds per step, paired ratios to DDP (median
over rounds of the same round's ratio, and each round's CPU ratio beside it: the spread), peak RSS per rank
(and peak device memory on CUDA) and its ratio to DDP's, and the last loss. fp32 contenders do the same math,
so their last losses must agree to 1e-4 relative: the run fails otherwise. Targets (issue 21): every zerospeed
stage ≤ 1.02× DDP's step time; stage 2 with accumulation 2 ≤ 1.05×.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # count devices without initialising CUDA (fork)

try:  # run as ``python benchmarks/bench_peers.py`` (script dir on sys.path) or as a package module
    from contenders import BenchSpec, Contender, ddp, deepspeed_stage, fsdp2, untrimmed, zerospeed_stage
    from harness import Result, run_all
except ImportError:  # pragma: no cover
    from benchmarks.contenders import BenchSpec, Contender, ddp, deepspeed_stage, fsdp2, untrimmed, zerospeed_stage
    from benchmarks.harness import Result, run_all

from zerospeed.models import GPT, PRESETS  # noqa: E402

BASELINE = "torch DDP"
SIZES = ("mid", "gpt2-small")
LOCAL = {"zero_local_grad_accumulation": True}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
# issue 38's sweep: size -> (micro-batch, warm-up steps, timed steps), sized so one size takes minutes on 2 cores
SWEEP = {"7m": (8, 1, 6), "27m": (8, 1, 4), "gpt2-small": (2, 1, 2), "350m": (2, 1, 2)}
BEGIN, END = "<!-- bench_peers:begin -->", "<!-- bench_peers:end -->"
LOSS_RTOL = {"fp32": 1e-4, "bf16": 3e-2}  # bf16: torch autocast and zerospeed's bf16 weights round differently


def contenders(part: str, device: str, trim_pairs: bool = False) -> list[Contender]:
    """The contenders of one part (``gas1``: all; ``gas2``: the accumulation comparison); ``trim_pairs`` adds
    zerospeed stages 2 and 3 with the heap trim off beside their default (the trade-off of issue 38)."""
    if part == "gas2":
        return [ddp(), fsdp2(reshard_after_forward=False, name="torch FSDP2 (no reshard)"),
                deepspeed_stage(2, device), zerospeed_stage(2),
                zerospeed_stage(2, name="zerospeed stage 2, local accumulation", extra=LOCAL)]
    return [ddp(), *([ddp(fused=True)] if device == "cpu" else []),
            fsdp2(reshard_after_forward=False, name="torch FSDP2 (no reshard)"), fsdp2(),
            *(deepspeed_stage(s, device) for s in range(4)), *(zerospeed_stage(s) for s in range(4)),
            *([untrimmed(zerospeed_stage(s)) for s in (2, 3)] if trim_pairs else []),
            zerospeed_stage(2, OFFLOAD, name="zerospeed stage 2, CPU offload")]


def check_losses(results: list[Result], dtype: str) -> None:
    """Same math, same data: every last loss agrees with the baseline's (AssertionError names the outlier)."""
    base = next(r.last_loss for r in results if r.contender == BASELINE)
    for r in results:
        assert abs(r.last_loss - base) <= LOSS_RTOL[dtype] * abs(base), \
            f"{r.contender}: last loss {r.last_loss:.6f} differs from {BASELINE}'s {base:.6f}"


def table(spec: BenchSpec, results: list[Result]) -> str:
    """One markdown table: step time, CPU time and peak memory, each with its ratio to DDP."""
    cfg = PRESETS[spec.preset]()
    base = next(r for r in results if r.contender == BASELINE)
    n = GPT(cfg).num_params()
    head = (f"**{spec.preset}** ({n / 1e6:.1f}M parameters, seq {cfg.block_size}), micro-batch {spec.micro_batch}, "
            f"gradient accumulation {spec.grad_accum}, world {spec.world_size}, {spec.dtype}, {spec.device}: "
            f"{spec.warmup} warm-up + {spec.steps} timed steps per round")
    mem = "peak device MiB/rank" if spec.device == "cuda" else "peak RSS MiB/rank"
    rows = ["| contender | s/step | ÷ DDP | CPU s/step | ÷ DDP | CPU ÷ DDP per round | " + mem + " | ÷ DDP | last loss |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        peak = r.peak_device_mib if spec.device == "cuda" else r.peak_rss_mib
        base_peak = base.peak_device_mib if spec.device == "cuda" else base.peak_rss_mib
        rows.append(f"| {r.contender} | {r.wall_s_per_step:.3f} | {r.ratio:.3f} | {r.cpu_s_per_step:.3f} | "
                    f"{r.cpu_ratio:.3f} | {' / '.join(f'{x:.3f}' for x in r.cpu_ratios or [])} | {peak:.0f} | "
                    f"{peak / base_peak:.3f} | {r.last_loss:.6f} |")
    return "\n".join([head, "", *rows])


def write_section(path: str, text: str) -> None:
    """Replace what lies between the ``bench_peers`` markers in ``path`` with ``text``."""
    with open(path) as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} markers to write between")
    doc = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: f"{BEGIN}\n{text}\n{END}", doc, flags=re.S)
    with open(path, "w") as f:
        f.write(doc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", choices=sorted(PRESETS), default=list(SIZES))
    p.add_argument("--parts", nargs="+", choices=["gas1", "gas2"], default=["gas1", "gas2"])
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeat", type=int, help="interleaved rounds; ratios are paired per round (3; --sweep 2)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--only", nargs="+", metavar="TEXT", help="only contenders whose name contains one of these "
                   "(DDP, the baseline, always runs)")
    p.add_argument("--quick", action="store_true", help="mid size only, 2 rounds of 3 timed steps (a few minutes)")
    p.add_argument("--sweep", action="store_true", help="issue 38's size sweep: 7m, 27m, gpt2-small and 350m, gas1, "
                   "2 interleaved rounds, micro-batch and steps per size (SWEEP; about 50 minutes on 2 cores)")
    p.add_argument("--trim-pairs", action="store_true", help="add zerospeed stages 2 and 3 with the heap trim off")
    p.add_argument("--write", metavar="DOC", help="write the tables between the bench_peers markers of DOC")
    a = p.parse_args()
    if a.quick:
        a.sizes, a.repeat, a.steps = ["mid"], 2, 3
    if a.sweep:  # --sizes narrows the sweep to some of its sizes
        a.sizes = [s for s in a.sizes if s in SWEEP] if a.sizes != list(SIZES) else list(SWEEP)
        a.parts = ["gas1"]
    a.repeat = a.repeat or (2 if a.sweep else 3)
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench_peers: --device cuda but no CUDA device here; nothing to measure")
            return 0
        if torch.cuda.device_count() < a.world:
            print(f"bench_peers: {torch.cuda.device_count()} CUDA device(s) for world {a.world}: running world "
                  f"{torch.cuda.device_count()} (the ratios then measure each engine's own overhead, not sharding)")
            a.world = torch.cuda.device_count()
    out = []
    for size in a.sizes:
        micro, warmup, steps = SWEEP[size] if a.sweep else (a.micro_batch, a.warmup, a.steps)
        for part in a.parts:
            spec = BenchSpec(preset=size, micro_batch=micro, grad_accum=1 if part == "gas1" else 2,
                             world_size=a.world, warmup=warmup, steps=steps, device=a.device, dtype=a.dtype)
            print(f"== {size} {part} ==", flush=True)
            chosen = [c for c in contenders(part, a.device, a.trim_pairs)
                      if a.only is None or c.name == BASELINE or any(t in c.name for t in a.only)]
            results = run_all(spec, chosen, baseline=BASELINE, repeat=a.repeat)
            text = table(spec, results)
            print(text + "\n", flush=True)
            out.append(text)
            check_losses(results, a.dtype)
    if a.write:
        write_section(a.write, "\n\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
