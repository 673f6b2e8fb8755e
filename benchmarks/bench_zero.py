"""ZeRO stages 1-3: zerospeed vs torch DDP / FSDP2 (and DeepSpeed when installed), same model, data, batch.

    .venv/bin/python benchmarks/bench_zero.py [--preset demo] [--steps 10] [--repeat 3] [--json]

Two comparisons, each with its own baseline and paired ratios:

* stages 1-2 (and 0) against ``torch DDP``, with FSDP2 ``reshard_after_forward=False`` (ZeRO-2-like);
* stage 3 against FSDP2 ``reshard_after_forward=True`` (parameters re-gathered for backward).

Then, per contender, the model-state bytes a rank holds against the ZeRO formula for fp32 training
(16Ψ, 8Ψ+12Ψ/N, 4Ψ+16Ψ/N, 16Ψ/N) and the bytes it communicated in the last step against the ZeRO
paper's count, generalised to ``gas`` micro-batches per step: stages 0-1 move 2Ψ per step (one
reduction and one all-gather at the boundary), stage 2 reduce-scatters every micro-batch ((gas+1)Ψ),
stage 3 also gathers parameters for every forward and backward (3Ψ per micro-batch).
Acceptance targets (issues 3 and 4): stages 1-2 at most 1.05x DDP's wall s/step; stage 3 at most 1.0x FSDP2's.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from contenders import BenchSpec, Contender, ddp, deepspeed_stage, fsdp2, zerospeed_stage
from harness import MiB, Result, emit, run_all

from zerospeed.models import GPT, PRESETS

DP_BASELINE = "torch DDP"
Z3_BASELINE = "torch FSDP2"
# Which ZeRO formula a contender's state follows (FSDP2 shards params, grads and optimizer state alike).
STAGE_OF = {"torch DDP": 0, "torch FSDP2 (no reshard)": 3, "torch FSDP2": 3}


def stage_of(name: str) -> int | None:
    if name in STAGE_OF:
        return STAGE_OF[name]
    for word in name.split():
        if word.rstrip(",").isdigit():
            return int(word.rstrip(","))
    return None


def state_formula(stage: int, n: int, grads: bool = True) -> tuple[float, str]:
    """fp32 training: bytes per parameter a rank holds, and the formula (``grads=False``: without gradients)."""
    if not grads:  # DeepSpeed's gradient buffers are internal: its count leaves them out
        return {0: (12, "12Ψ (no grads)"), 1: (4 + 12 / n, "4Ψ+12Ψ/N (no grads)"),
                2: (4 + 12 / n, "4Ψ+12Ψ/N (no grads)"), 3: (12 / n, "12Ψ/N (no grads)")}[stage]
    return {0: (16, "16Ψ"), 1: (8 + 12 / n, "8Ψ+12Ψ/N"), 2: (4 + 16 / n, "4Ψ+16Ψ/N"),
            3: (16 / n, "16Ψ/N")}[stage]


def comm_formula(stage: int, gas: int) -> tuple[float, str]:
    """Elements (in units of Ψ) a rank moves per optimizer step of ``gas`` micro-batches."""
    if stage <= 1:
        return 2, "2Ψ"
    if stage == 2:
        return gas + 1, "2Ψ" if gas == 1 else f"(gas+1)Ψ={gas + 1}Ψ"
    return 3 * gas, "3Ψ" if gas == 1 else f"3Ψ·gas={3 * gas}Ψ"


def accounting(spec: BenchSpec, results: list[Result]) -> list[dict[str, Any]]:
    """Measured state and communication against the formulas (fp32: 4 bytes per element)."""
    psi = sum(p.numel() for p in GPT(PRESETS[spec.preset]()).parameters())
    rows = []
    for r in results:
        stage = stage_of(r.contender)
        if stage is None:
            continue
        per_param, sform = state_formula(stage, r.world_size, grads=not r.contender.startswith("DeepSpeed"))
        cpsi, cform = comm_formula(stage, spec.grad_accum)
        comm = None if r.comm_bytes_per_step is None else r.comm_bytes_per_step / (4 * psi)
        rows.append({"contender": r.contender, "stage": stage, "psi": psi, "state_mib": r.state_mib,
                     "state_theory_mib": per_param * psi / MiB, "state_formula": sform,
                     "state_ratio": r.state_mib / (per_param * psi / MiB),
                     "comm_psi": comm, "comm_theory_psi": cpsi, "comm_formula": cform,
                     "comm_ratio": None if comm is None else comm / cpsi})
    return rows


def format_accounting(rows: list[dict[str, Any]], world: int) -> str:
    cols = ["contender", "formula", "state MiB/rank", "theory MiB", "accounted/theory", "comm/step (Ψ)",
            "theory", "accounted/theory"]
    body = [[r["contender"], r["state_formula"], f"{r['state_mib']:.2f}", f"{r['state_theory_mib']:.2f}",
             f"{r['state_ratio']:.3f}", "-" if r["comm_psi"] is None else f"{r['comm_psi']:.3f}",
             "-" if r["comm_psi"] is None else r["comm_formula"], "-" if r["comm_ratio"] is None else f"{r['comm_ratio']:.3f}"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(cols, *body)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    head = f"Ψ = {rows[0]['psi']:,} parameters, N = {world} ranks, fp32 (4 bytes per element)" if rows else ""
    return "\n".join([head, "", line(cols), sep, *(line(b) for b in body)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per rank per step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the median round is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--part", choices=["all", "12", "3"], default="all", help="stages 0-2 vs DDP, stage 3 vs FSDP2")
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out even when installed")
    p.add_argument("--json", action="store_true", help="one JSON object per contender instead of tables")
    args = p.parse_args()
    spec = BenchSpec(preset=args.preset, micro_batch=args.micro_batch, grad_accum=args.grad_accum, world_size=2,
                     warmup=args.warmup, steps=args.steps, seed=args.seed)
    ds = (lambda s: []) if args.no_deepspeed else (lambda s: [deepspeed_stage(s)])  # noqa: E731
    parts: list[tuple[str, str, list[Contender]]] = []
    if args.part in ("all", "12"):
        parts.append(("zero12", DP_BASELINE, [
            ddp(), fsdp2(reshard_after_forward=False, name="torch FSDP2 (no reshard)"),
            zerospeed_stage(0), zerospeed_stage(1), zerospeed_stage(2), *ds(0), *ds(1), *ds(2)]))
    if args.part in ("all", "3"):
        parts.append(("zero3", Z3_BASELINE, [
            fsdp2(reshard_after_forward=True), zerospeed_stage(3),
            zerospeed_stage(3, {"stage3_param_persistence_threshold": 0}, name="zerospeed stage 3, persist 0"),
            *ds(3)]))
    for bench, baseline, contenders in parts:
        results = run_all(spec, contenders, baseline=baseline, repeat=args.repeat, log=not args.json)
        rows = accounting(spec, results)
        emit(spec, results, args.json, baseline, bench=bench)
        if args.json:
            for row in rows:
                print(json.dumps({"bench": bench + "_accounting", **row}))
        else:
            print()
            print(format_accounting(rows, spec.world_size))
            print()


if __name__ == "__main__":
    main()
