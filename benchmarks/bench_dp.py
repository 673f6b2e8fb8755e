"""Data parallelism: zerospeed ZeRO stage 0 vs torch DDP vs one process, same model, data and global batch.

    .venv/bin/python benchmarks/bench_dp.py [--preset demo] [--steps 10] [--repeat 3] [--json]

Acceptance target (issue 2): zerospeed stage 0 within 10% of DDP's wall seconds per step.
"""

from __future__ import annotations

import argparse

from contenders import BenchSpec, ddp, single, zerospeed_stage
from harness import emit, run_all

from zerospeed.models import PRESETS

BASELINE = "torch DDP"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=2, help="per rank at world size 2")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeat", type=int, default=1, help="interleaved rounds; the median round is reported")
    p.add_argument("--single-threads", type=int, default=1, help="intra-op threads of the one-process run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object per contender instead of a table")
    args = p.parse_args()
    spec = BenchSpec(preset=args.preset, micro_batch=args.micro_batch, grad_accum=args.grad_accum, world_size=2,
                     warmup=args.warmup, steps=args.steps, seed=args.seed)
    contenders = [zerospeed_stage(0), ddp(), single(args.single_threads)]
    results = run_all(spec, contenders, baseline=BASELINE, repeat=args.repeat, log=not args.json)
    emit(spec, results, args.json, BASELINE, bench="dp")


if __name__ == "__main__":
    main()
