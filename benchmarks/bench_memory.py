"""Peak memory per rank: zerospeed ZeRO-2/3 vs torch DDP, FSDP2 and DeepSpeed, same model, data and batch.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_memory.py --preset gpt2s [--steps 2] [--repeat 1] [--json]
    PYTHONPATH=src DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python benchmarks/bench_memory.py --preset gpt2s  # + DeepSpeed

Every contender runs in its own two forked Gloo ranks (``harness.run_contender``), fp32, AdamW, gradient
clipping, ``warmup + steps`` optimizer steps (memory needs no long run: the optimizer state exists after the
first step, so the second step shows the steady peak). Reported per contender, max over ranks:

* ``peak RSS`` — the kernel's high-water mark of the rank's resident set (``ru_maxrss``) over the whole run,
  which includes the interpreter, torch and the pages shared with the parent at fork;
* ``start RSS`` — the same counter when the rank began (the baseline every contender shares);
* ``peak − start`` — what the training itself added, the figure the ratios are taken on;
* ``vs DDP`` / ``vs FSDP2`` — peak RSS over the baseline's peak RSS, paired per round (median of rounds).

Issue 21's targets, GPT-2-small shape: zerospeed ZeRO-3 ≤ FSDP2 (``reshard_after_forward=True``) and
≤ 0.85 × DDP; zerospeed ZeRO-2 ≤ DeepSpeed ZeRO-2. Contenders run interleaved; RSS is reliable under load,
step time is not (it is printed only as a sanity figure).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from typing import Any

from contenders import BenchSpec, Contender, ddp, deepspeed_stage, fsdp2, untrimmed, zerospeed_stage
from harness import Result, run_contender, runnable_contenders

from zerospeed.launcher.memory_report import gpt2s
from zerospeed.models import GPT, PRESETS

PRESETS.setdefault("gpt2s", gpt2s)  # the GPT-2-small shape; forked ranks inherit the table

BASELINES = ("torch DDP", "torch FSDP2")


def contenders(include_ds: bool, trim_pairs: bool = False) -> list[Contender]:
    """In the order they run (most telling pairs first, so an interrupted run still answers the targets);
    ``trim_pairs``: each zerospeed contender also without the heap trimming (``accelerator/host_malloc.py``)."""
    ds = (lambda s: [deepspeed_stage(s)]) if include_ds else (lambda s: [])  # noqa: E731
    pair = (lambda c: [c, untrimmed(c)]) if trim_pairs else (lambda c: [c])  # noqa: E731
    return [*pair(zerospeed_stage(2)), *ds(2),
            *pair(zerospeed_stage(3, {"stage3_max_reuse_distance": 0}, name="zerospeed stage 3, reuse 0")),
            fsdp2(reshard_after_forward=True), ddp(), *pair(zerospeed_stage(3)), *ds(3)]


def run(spec: BenchSpec, cands: list[Contender], repeat: int) -> dict[str, list[Result]]:
    runnable = runnable_contenders(cands)
    rounds: dict[str, list[Result]] = {c.name: [] for c in runnable}
    for r in range(repeat):
        for c in runnable:
            res = run_contender(spec, c)
            rounds[c.name].append(res)
            print(f"  round {r + 1}/{repeat} {c.name}: peak RSS {res.peak_rss_mib:.0f} MiB/rank "
                  f"(start {res.start_rss_mib:.0f}), {res.wall_s_per_step:.1f} s/step, loss {res.last_loss:.4f}",
                  flush=True)
    return rounds


def summarise(rounds: dict[str, list[Result]]) -> list[dict[str, Any]]:
    rows = []
    for name, rs in rounds.items():
        row: dict[str, Any] = {
            "contender": name,
            "peak_rss_mib": statistics.median(r.peak_rss_mib for r in rs),
            "start_rss_mib": statistics.median(r.start_rss_mib for r in rs),
            "growth_mib": statistics.median(r.peak_rss_mib - r.start_rss_mib for r in rs),
            "state_mib": rs[0].state_mib,
            "wall_s_per_step": statistics.median(r.wall_s_per_step for r in rs),
            "last_loss": rs[0].last_loss,
            "rounds": [asdict(r) for r in rs],
        }
        for base in BASELINES:
            if base in rounds:
                row["vs " + base] = statistics.median(a.peak_rss_mib / b.peak_rss_mib
                                                      for a, b in zip(rs, rounds[base]))
        rows.append(row)
    return rows


def format_rows(spec: BenchSpec, rows: list[dict[str, Any]]) -> str:
    cfg = PRESETS[spec.preset]()
    n = GPT(cfg).num_params()
    head = (f"GPT[{spec.preset}] {n / 1e6:.1f}M params, seq {cfg.block_size}, micro-batch {spec.micro_batch} x "
            f"{spec.grad_accum} accumulation x {spec.world_size} ranks, fp32 AdamW, {spec.warmup + spec.steps} steps")
    cols = ["contender", "peak RSS MiB/rank", "start MiB", "peak − start MiB", "vs DDP", "vs FSDP2",
            "state MiB/rank", "s/step (under load)", "last loss"]
    fmt = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    body = [[r["contender"], f"{r['peak_rss_mib']:.0f}", f"{r['start_rss_mib']:.0f}", f"{r['growth_mib']:.0f}",
             fmt(r.get("vs torch DDP")), fmt(r.get("vs torch FSDP2")), f"{r['state_mib']:.0f}",
             f"{r['wall_s_per_step']:.1f}", f"{r['last_loss']:.4f}"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(cols, *body)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([head, "", line(cols), sep, *(line(b) for b in body)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpt2s")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per rank per step")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--repeat", type=int, default=1, help="interleaved rounds; medians are reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="semicolon-separated contender names to run (default: all)")
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out even when installed")
    p.add_argument("--json", action="store_true", help="one JSON object per contender after the table")
    p.add_argument("--trim-pairs", action="store_true",
                   help="run each zerospeed contender also with ZEROSPEED_TRIM_HEAP=0 (the heap trimming off)")
    args = p.parse_args()
    spec = BenchSpec(preset=args.preset, micro_batch=args.micro_batch, grad_accum=args.grad_accum, world_size=2,
                     warmup=args.warmup, steps=args.steps, seed=args.seed)
    cands = contenders(not args.no_deepspeed, args.trim_pairs)
    if args.only:
        wanted = {w.strip() for w in args.only.split(";")}
        cands = [c for c in cands if c.name in wanted]
    rows = summarise(run(spec, cands, args.repeat))
    print()
    print(format_rows(spec, rows))
    if args.json:
        for row in rows:
            print(json.dumps({"bench": "memory", **asdict(spec), **row}))


if __name__ == "__main__":
    main()
