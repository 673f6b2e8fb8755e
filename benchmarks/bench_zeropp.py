"""ZeRO++ on 2 simulated nodes: plain ZeRO-3 vs qwZ vs qwZ+hpZ vs qwZ+hpZ+qgZ, the demo GPT, forked Gloo ranks.

    python benchmarks/bench_zeropp.py --steps 40 [--world 4 --ranks-per-node 2] [--json] [--only plain,all]

Every contender trains ``GPT(demo)`` at stage 3 (fp32, Adam lr 1e-3), micro-batch 8 x seq 128 per rank, on
the same seeded batches, with every parameter partitioned (persistence threshold 0) and none kept from
forward to backward (reuse distance 0), as for a model too large to keep gathered: backward gathers
again, which is where hpZ acts (at DeepSpeed's defaults this small model would stay gathered). Nodes are simulated: ``LOCAL_WORLD_SIZE``
ranks per node (qgZ's node size) and ``zero_hpz_partition_size`` = that size. Bytes are the message bytes
the comms logger counted on rank 0, split by the group each collective ran on: *intra* (all its ranks
on one node) or *inter* (its ranks span nodes, e.g. the world group), per step, averaged over the steps
after the first. The first step records the module order and runs its forward from the primary partition;
later ones are the steady state. Reported: first loss, mean loss of the last 10 steps and its ratio to
plain ZeRO-3's, wall and CPU seconds per step. A benchmark prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from zerospeed.data import ByteDataset
from zerospeed.models import GPT, PRESETS
from zerospeed.testing import run_distributed

MICRO = 8


def contenders(ranks_per_node: int) -> dict[str, dict[str, Any]]:
    qwz = {"zero_quantized_weights": True}
    hpz = {**qwz, "zero_hpz_partition_size": ranks_per_node}
    return {"plain": {}, "qwZ": qwz, "qwZ+hpZ": hpz, "qwZ+hpZ+qgZ": {**hpz, "zero_quantized_gradients": True}}


def batch(data: ByteDataset, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    idx = torch.randint(len(data), (MICRO * world,), generator=g)[rank * MICRO:(rank + 1) * MICRO].tolist()
    return torch.stack([data[i][0] for i in idx]), torch.stack([data[i][1] for i in idx])


def _split(stats: dict[str, Any], ranks_per_node: int) -> tuple[int, int]:
    """(intra, inter) message bytes: by whether a collective's group stays on one node."""
    intra = inter = 0
    for st in stats.values():
        for ranks, nbytes in st.groups.items():
            if len({r // ranks_per_node for r in ranks}) == 1:
                intra += nbytes
            else:
                inter += nbytes
    return intra, inter


def run(zero: dict[str, Any], steps: int, ranks_per_node: int) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    import zerospeed
    from zerospeed import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    cfg = PRESETS["demo"]()
    model = GPT(cfg, seed=0)
    data = ByteDataset(cfg.block_size, "train")
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0, **zero}}
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses, split, wall, cpu = [], [], 0.0, 0.0
    for step in range(steps):
        x, y = batch(data, step, rank, world)
        comm.COMMS_LOGGER.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if step > 0:
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
        split.append(_split(comm.COMMS_LOGGER.snapshot(), ranks_per_node))
        total = loss.detach().clone()
        comm.all_reduce(total)
        losses.append(float(total) / world)
    n = max(1, steps - 1)
    return {"losses": losses, "intra": sum(s[0] for s in split[1:]) / n, "inter": sum(s[1] for s in split[1:]) / n,
            "s_per_step": wall / n, "cpu_per_step": cpu / n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated contender names (default: all)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    table = contenders(args.ranks_per_node)
    names = [n for n in table if not args.only or n in args.only.split(",")]
    n_params = GPT(PRESETS["demo"](), seed=0).num_params()
    print(f"GPT[demo] {n_params / 1e6:.2f}M params | world {args.world} ({args.world // args.ranks_per_node} nodes x "
          f"{args.ranks_per_node}) | stage 3 fp32 | micro {MICRO} x seq 128 | {args.steps} steps")
    print(f"{'contender':<14}{'first':>8}{'last10':>9}{'vs plain':>9}{'intra B/step':>14}{'inter B/step':>14}"
          f"{'inter vs plain':>15}{'s/step':>8}{'cpu s':>8}")
    plain: dict[str, Any] | None = None
    for name in names:
        r = run_distributed(run, args.world, table[name], args.steps, args.ranks_per_node, timeout=6 * 3600)[0]
        last10 = sum(r["losses"][-10:]) / len(r["losses"][-10:])
        if name == "plain":
            plain = {**r, "last10": last10}
        vs = last10 / plain["last10"] if plain else float("nan")
        inter_vs = r["inter"] / plain["inter"] if plain and plain["inter"] else float("nan")
        row = {"contender": name, "world": args.world, "ranks_per_node": args.ranks_per_node, "steps": args.steps,
               "first_loss": r["losses"][0], "last10_loss": last10, "vs_plain": vs, "intra_bytes_per_step": r["intra"],
               "inter_bytes_per_step": r["inter"], "inter_vs_plain": inter_vs, "s_per_step": r["s_per_step"],
               "cpu_s_per_step": r["cpu_per_step"]}
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"{name:<14}{r['losses'][0]:>8.3f}{last10:>9.3f}{vs:>9.3f}{r['intra']:>14,.0f}{r['inter']:>14,.0f}"
                  f"{inter_vs:>15.3f}{r['s_per_step']:>8.2f}{r['cpu_per_step']:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
