"""Muon vs AdamW under ZeRO-2: the demo GPT, same data and seed, forked Gloo ranks, contenders interleaved.

    python benchmarks/bench_muon.py --steps 20 --rounds 2 --world 2 [--stage 2] [--json]

Each contender trains ``GPT(demo)`` (1.9M parameters; micro-batch 8 x seq 128 per rank, one micro-batch per
step, clipping 1.0) for ``--steps`` steps; the rounds run the contenders alternately (A B A B), so a change of
machine load hits both. Muon runs DeepSpeed's split (``optim/muon_groups.py``) with the demo's embeddings
``wte`` (tied with the head) and ``wpe`` tagged ``use_muon = False`` (DeepSpeed's name rule looks for
``embed`` / ``lm_head``, which these names do not contain). Reported per contender (median over rounds): wall
and CPU seconds per step (steps after the first), the seconds of the optimizer step alone (``engine.step()``
at the boundary: Muon's exchange and Newton-Schulz live there), the loss of the last step, and the CPU
milliseconds of one ``optimizer.step()`` over the whole model in one process, one thread like each rank (no
communication: the compute cost of the update itself). A benchmark
prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from zerospeed.data import ByteDataset
from zerospeed.models import GPT, PRESETS
from zerospeed.testing import run_distributed

MICRO = 8
CONTENDERS: dict[str, dict[str, Any]] = {
    "AdamW": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "Muon": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 2e-3, "momentum": 0.95, "betas": [0.9, 0.95],
                                        "weight_decay": 0.1}},
    "Muon-standard": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 2e-3, "momentum": 0.95,
                                                 "betas": [0.9, 0.95], "weight_decay": 0.1, "ns_method": "standard"}},
}


def batch(data: ByteDataset, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    idx = torch.randint(len(data), (MICRO * world,), generator=g)[rank * MICRO:(rank + 1) * MICRO].tolist()
    return torch.stack([data[i][0] for i in idx]), torch.stack([data[i][1] for i in idx])


def run(optimizer: dict[str, Any], steps: int, stage: int) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    cfg = PRESETS["demo"]()
    model = GPT(cfg, seed=0)
    model.wte.weight.use_muon = False  # type: ignore[attr-defined]  # embeddings (and the tied head) to Adam
    model.wpe.weight.use_muon = False  # type: ignore[attr-defined]
    data = ByteDataset(cfg.block_size, "train")
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "gradient_clipping": 1.0, "optimizer": optimizer, "zero_optimization": {"stage": stage}}
    engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    losses, step_s = [], []
    t0 = c0 = 0.0
    for step in range(steps):
        if step == 1:
            t0, c0 = time.perf_counter(), time.process_time()
        x, y = batch(data, step, rank, world)
        _, loss = engine(x, y)
        engine.backward(loss)
        s0 = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - s0)
        total = loss.detach().clone()
        comm.all_reduce(total)
        losses.append(float(total) / world)
    n = max(1, steps - 1)
    return {"losses": losses, "s_per_step": (time.perf_counter() - t0) / n, "cpu_per_step": (time.process_time() - c0) / n,
            "opt_step_s": statistics.median(step_s[1:] or step_s)}


def local_step_ms(optimizer: dict[str, Any], reps: int) -> float:
    """CPU milliseconds of one ``optimizer.step()`` over the demo GPT in this process (no communication)."""
    from zerospeed.optim import build_optimizer
    from zerospeed.optim.muon_groups import split_muon_groups, tag_use_muon

    model = GPT(PRESETS["demo"](), seed=0)
    groups: list[dict[str, Any]] = [{"params": list(model.parameters())}]
    if optimizer["type"] == "Muon":
        model.wte.weight.use_muon = False  # type: ignore[attr-defined]
        model.wpe.weight.use_muon = False  # type: ignore[attr-defined]
        tag_use_muon(model)
        groups = split_muon_groups(groups, optimizer["params"])
    opt = build_optimizer(optimizer["type"], optimizer["params"], groups)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    opt.step()
    times = []
    for _ in range(reps):
        c0 = time.process_time()
        opt.step()
        times.append(time.process_time() - c0)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated contender names (default: all)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    names = [n for n in CONTENDERS if not args.only or n in args.only.split(",")]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    torch.set_num_threads(1)  # as each forked rank runs (testing/harness.py)
    local = {n: local_step_ms(CONTENDERS[n], 10) for n in names}
    for _ in range(args.rounds):
        for name in names:
            runs[name].append(run_distributed(run, args.world, CONTENDERS[name], args.steps, args.stage,
                                              timeout=3600)[0])
    n_params = GPT(PRESETS["demo"](), seed=0).num_params()
    print(f"GPT[demo] {n_params / 1e6:.2f}M params | world {args.world} | ZeRO-{args.stage} | micro {MICRO} x seq 128 "
          f"| {args.steps} steps x {args.rounds} rounds (interleaved; medians)")
    print(f"{'optimizer':<15}{'s/step':>9}{'cpu s/step':>12}{'opt step s':>12}{'last loss':>11}{'1-proc step cpu ms':>20}")
    for name in names:
        rs = runs[name]
        row = {"optimizer": name, "world": args.world, "stage": args.stage, "steps": args.steps,
               "s_per_step": statistics.median(r["s_per_step"] for r in rs),
               "cpu_per_step": statistics.median(r["cpu_per_step"] for r in rs),
               "opt_step_s": statistics.median(r["opt_step_s"] for r in rs), "last_loss": rs[0]["losses"][-1],
               "local_step_cpu_ms": local[name]}
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"{name:<15}{row['s_per_step']:>9.3f}{row['cpu_per_step']:>12.3f}{row['opt_step_s']:>12.4f}"
                  f"{row['last_loss']:>11.3f}{row['local_step_cpu_ms']:>20.1f}", flush=True)


if __name__ == "__main__":
    main()
