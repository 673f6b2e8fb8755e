"""Memory of each precision variant (issue 32): bytes per parameter of the library's own buffers, and peak RSS.

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/bench_precision.py [--json]

Every variant trains the same GPT (a wide, short-sequence shape, so that model state dominates and bf16's slow
CPU matmuls stay cheap) at ZeRO stage 2 on two forked Gloo ranks (``harness.run_contender``), AdamW, two
optimizer steps. Per variant, per rank:

* accounted: ``engine.memory_breakdown()`` (the library's own buffers: model parameters, gradient buffers,
  master partition, optimizer state) divided by the parameter count Ψ, so a stage-2 fp32 gradient partition
  shows as 4/N = 2.0 bytes per parameter at N = 2;
* measured: the rank's peak RSS (``ru_maxrss``) and what the training added to it (peak − start), max over ranks.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from contenders import BenchSpec, Contender, zerospeed_stage
from harness import run_contender

from zerospeed.models import GPT, PRESETS, GPTConfig

PRESETS.setdefault("wide", lambda: GPTConfig(block_size=16, n_layer=4, n_head=8, n_embd=512))
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
BF16, FP16 = {"enabled": True}, {"enabled": True, "initial_scale_power": 8}


def variants() -> list[tuple[Contender, str]]:
    """(contender, what it is compared with) in run order."""
    v = lambda name, extra, zero=None: zerospeed_stage(2, zero, name=name, extra=extra)  # noqa: E731
    off = {"bf16": {"enabled": False}}
    return [
        (v("fp32", off), ""),
        (v("fp32 + torch_autocast bf16", {**off, "torch_autocast": {"enabled": True, "dtype": "bf16"}}), "fp32"),
        (v("bf16", {"bf16": BF16}), ""),
        (v("bf16 + immediate_grad_update", {"bf16": {**BF16, "immediate_grad_update": True}}), "bf16"),
        (v("bf16 + grad_accum_dtype bf16", {"bf16": BF16, "data_types": {"grad_accum_dtype": "bf16"}}), "bf16"),
        (v("bf16 + bf16 master/grads + bf16 states", {"bf16": {
            **BF16, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}), "bf16"),
        (v("bf16, cpu offload", {"bf16": BF16}, OFFLOAD), ""),
        (v("bf16 + bf16 master/grads, cpu offload", {"bf16": {**BF16, "bf16_master_weights_and_grads": True}},
           OFFLOAD), "bf16, cpu offload"),
        (v("bf16 + bf16 master/grads + bf16 states, cpu offload", {"bf16": {
            **BF16, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}, OFFLOAD),
         "bf16, cpu offload"),
        (v("fp16, cpu offload", {"bf16": {"enabled": False}, "fp16": FP16}, OFFLOAD), ""),
        (v("fp16 + fp16 master/grads, cpu offload", {"bf16": {"enabled": False}, "fp16": {
            **FP16, "fp16_master_weights_and_grads": True}}, OFFLOAD), "fp16, cpu offload"),
    ]


KINDS = ("params", "grads", "master", "optimizer_state")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="one JSON object per variant after the table")
    args = p.parse_args()
    spec = BenchSpec(preset="wide", micro_batch=2, grad_accum=1, world_size=2, warmup=1, steps=1)
    n = GPT(PRESETS["wide"]()).num_params()
    rows: list[dict[str, Any]] = []
    for contender, base in variants():
        res = run_contender(spec, contender)
        per_param = {k: res.state_detail.get(k, 0.0) * 2**20 / n for k in KINDS}
        rows.append({"variant": contender.name, "vs": base, "bytes_per_param": per_param,
                     "total_bytes_per_param": sum(per_param.values()), "peak_rss_mib": res.peak_rss_mib,
                     "growth_mib": res.peak_rss_mib - res.start_rss_mib, "last_loss": res.last_loss})
        print(f"  {contender.name}: {sum(per_param.values()):.2f} B/param, peak RSS {res.peak_rss_mib:.0f} MiB "
              f"(+{res.peak_rss_mib - res.start_rss_mib:.0f})", flush=True)
    by_name = {r["variant"]: r for r in rows}
    print(f"\nGPT[wide] {n / 1e6:.1f}M params (Ψ), ZeRO-2, 2 ranks, AdamW; accounted bytes per parameter per rank\n")
    print("| variant | params | grads | master | optimizer state | total | Δ vs | peak RSS MiB/rank | peak − start MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = r["bytes_per_param"]
        ref = by_name.get(r["vs"])
        delta = "" if ref is None else f"{r['total_bytes_per_param'] - ref['total_bytes_per_param']:+.2f} ({r['vs']})"
        print(f"| {r['variant']} | " + " | ".join(f"{b[k]:.2f}" for k in KINDS)
              + f" | {r['total_bytes_per_param']:.2f} | {delta} | {r['peak_rss_mib']:.0f} | {r['growth_mib']:.0f} |")
    if args.json:
        for r in rows:
            print(json.dumps({"bench": "precision", **asdict(spec), "params": n, **r}))


if __name__ == "__main__":
    main()
