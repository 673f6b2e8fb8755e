"""The offloaded optimizer step end to end: a stack of large linear layers (N parameters, a tiny batch so
the step dominates) trained through ``zerospeed.initialize`` with ZeRO stage 1 on one rank, AdamW state
on the accelerator (here: in memory, no offload), on the host (``cpu``) and in swap files (``nvme``).

Reported per setting: median seconds per optimizer step (wall and CPU), for nvme how long the step waited
on reads and on writes (the pipeline hides the rest), bytes of state on disk, and peak RSS of the rank.

    python benchmarks/bench_offload_step.py [--params 100_000_000] [--dir /work] [--sub_group 10_000_000] [--bf16]

In fp32 on one rank the fp32 master *is* the model; ``--bf16`` gives the rank a separate fp32 master
partition (4 bytes per parameter), which ``nvme`` keeps in its swap files rather than in memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn

from zerospeed.testing import run_distributed


def _run(offload: dict[str, Any], width: int, layers: int, sub_group: int, steps: int,
         bf16: bool = False) -> dict[str, Any]:
    import zerospeed

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 1, "sub_group_size": sub_group, "offload_optimizer": offload},
           "aio": {"block_size": 4 << 20, "intra_op_parallelism": 2}, "bf16": {"enabled": bf16}}
    engine, opt, _, _ = zerospeed.initialize(model=model, config=cfg)
    x = torch.randn(1, width, dtype=torch.bfloat16 if bf16 else torch.float32)
    walls, cpus, stats = [], [], []
    for _ in range(steps + 1):
        loss = engine(x).square().mean()
        engine.backward(loss)
        w, c = time.perf_counter(), time.process_time()
        engine.step()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
        if opt.stepper is not None:
            stats.append(dict(opt.stepper.last_stats))
    out = {"device": offload["device"], "params": sum(p.numel() for p in model.parameters()),
           "step_s": statistics.median(walls[1:]), "cpu_s": statistics.median(cpus[1:]),
           "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
           "disk_gib": opt.stepper.disk_bytes() / 2**30 if opt.stepper is not None else 0.0,
           "last_loss": float(loss.detach())}
    if stats and stats[-1]:
        out.update(read_wait_s=statistics.median(s["read_wait_s"] for s in stats[1:]),
                   write_wait_s=statistics.median(s["write_wait_s"] for s in stats[1:]),
                   compute_s=statistics.median(s["compute_s"] for s in stats[1:]),
                   subgroups=int(stats[-1]["subgroups"]))
    if opt.stepper is not None:
        opt.stepper.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--sub_group", type=int, default=10_000_000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", default="/work")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", choices=["none", "cpu", "nvme"], help="run one setting only")
    ap.add_argument("--bf16", action="store_true", help="bf16 compute (a separate fp32 master partition)")
    args = ap.parse_args()
    width = int((args.params / args.layers) ** 0.5)
    with tempfile.TemporaryDirectory(dir=args.dir) as nvme:
        rows = []
        for off in ({"device": "none"}, {"device": "cpu"}, {"device": "nvme", "nvme_path": nvme}):
            if args.only and off["device"] != args.only:
                continue
            rows.append(run_distributed(_run, 1, off, width, args.layers, args.sub_group, args.steps, args.bf16,
                                        timeout=1800)[0])
    for r in rows:
        if args.json:
            print(json.dumps(r))
        else:
            extra = (f"  read wait {r['read_wait_s']:.3f}s  write wait {r['write_wait_s']:.3f}s  update "
                     f"{r['compute_s']:.3f}s  ({r['subgroups']} sub-groups)" if "read_wait_s" in r else "")
            print(f"{r['device']:>5}: {r['params'] / 1e6:.0f}M params  step {r['step_s']:.3f}s wall "
                  f"{r['cpu_s']:.3f}s cpu  peak RSS {r['peak_rss_gib']:.2f} GiB  disk {r['disk_gib']:.2f} GiB{extra}")


if __name__ == "__main__":
    main()
