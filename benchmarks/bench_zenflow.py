"""Step time and convergence of CPU offload variants on a small GPT (``zerospeed.models.gpt``), world 2, ZeRO-2:
full offload (``ratio: 1``), partial offload (``ratio: 0.5``), ZenFlow (sync, and ``overlap_step``); and, at
ZeRO-3 without clipping, full offload against SuperOffload (``super_offload``: host steps started in backward).

Every rank builds one engine per contender (same seed, same model) and trains them on identical batches of the
bundled corpus, interleaved: each round gives every contender ``--round-steps`` steps in turn, so machine load
hits them alike. Reported per contender: median wall seconds per iteration (forward + backward + step) and per
``engine.step()``, CPU seconds per iteration, and the mean loss of the last ``--tail`` steps (its gap to full
offload is ZenFlow's convergence cost).

    python benchmarks/bench_zenflow.py [--model demo|tiny|bench] [--rounds 4] [--round-steps 10] [--micro 8]
        [--topk 0.1] [--update 4] [--select 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from zerospeed.testing import run_distributed

CONTENDERS: dict[str, dict[str, Any]] = {
    "offload": {"offload_optimizer": {"device": "cpu"}},
    "ratio-0.5": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}},
    "zenflow": {"offload_optimizer": {"device": "cpu"}, "zenflow": {}},
    "zenflow-overlap": {"offload_optimizer": {"device": "cpu"}, "zenflow": {"overlap_step": True}},
    # SuperOffload speculates only without clipping (as DeepSpeed), at stage 3: compare it with its own baseline
    "offload-z3-noclip": {"stage": 3, "gradient_clipping": 0.0, "offload_optimizer": {"device": "cpu"}},
    "super-offload": {"stage": 3, "gradient_clipping": 0.0, "offload_optimizer": {"device": "cpu",
                                                                                "super_offload": True}},
}


def config(name: str, micro: int, lr: float, topk: float, update: int, select: int) -> dict[str, Any]:
    contender = json.loads(json.dumps(CONTENDERS[name]))
    clip = contender.pop("gradient_clipping", 1.0)
    zero = {"stage": 2, "sub_group_size": 200_000, **contender}
    if "zenflow" in zero:
        zero["zenflow"].update(topk_ratio=topk, select_strategy="step", select_interval=select, update_interval=update)
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "gradient_clipping": clip, "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
            "zero_optimization": zero}


def batches(block: int, micro: int, rank: int, world: int, steps: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """Rank ``rank``'s micro-batches: the same global batches for every contender."""
    from zerospeed.data import ByteDataset

    data = ByteDataset(block, "train")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = torch.randint(len(data), (micro * world,), generator=gen)[rank * micro:(rank + 1) * micro]
        xs, ys = zip(*(data[int(i)] for i in idx))
        out.append((torch.stack(xs), torch.stack(ys)))
    return out


def train(names: list[str], model: str, micro: int, rounds: int, round_steps: int, lr: float, topk: float,
          update: int, select: int) -> dict[str, dict[str, Any]]:
    """One rank: every contender's engine, trained round-robin; per contender its losses and timings."""
    import zerospeed
    from zerospeed import comm
    from zerospeed.models import gpt

    cfg = getattr(gpt, model)()
    world, rank = comm.get_world_size(), comm.get_rank()
    data = batches(cfg.block_size, micro, rank, world, rounds * round_steps)
    runs: dict[str, dict[str, Any]] = {}
    for name in names:
        engine = zerospeed.initialize(model=gpt.GPT(cfg, seed=0), config=config(name, micro, lr, topk, update,
                                                                                  select))[0]
        runs[name] = {"engine": engine, "losses": [], "iter_s": [], "step_s": [], "cpu_s": []}
    for r in range(rounds):
        for name in names:
            run = runs[name]
            for s in range(r * round_steps, (r + 1) * round_steps):
                x, y = data[s]
                comm.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                loss = run["engine"](x, y)[1]
                run["engine"].backward(loss)
                t1 = time.perf_counter()
                run["engine"].step()
                t2 = time.perf_counter()
                run["iter_s"].append(t2 - t0)
                run["step_s"].append(t2 - t1)
                run["cpu_s"].append(time.process_time() - c0)
                total = loss.detach().clone()
                comm.all_reduce(total)
                run["losses"].append(float(total) / world)
    for run in runs.values():
        stepper = run.pop("engine").optimizer.stepper
        if stepper is not None:
            stepper.close()
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo", choices=["tiny", "demo", "bench"])
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--round-steps", type=int, default=10)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--topk", type=float, default=0.1)
    ap.add_argument("--update", type=int, default=4)
    ap.add_argument("--select", type=int, default=16)
    ap.add_argument("--tail", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    names = a.contenders.split(",")
    res = run_distributed(train, 2, names, a.model, a.micro, a.rounds, a.round_steps, a.lr, a.topk, a.update,
                          a.select, timeout=7200)[0]
    base = statistics.mean(res[names[0]]["losses"][-a.tail:])
    skip = a.round_steps  # the first round warms up
    rows = []
    for name in names:
        r = res[name]
        tail = statistics.mean(r["losses"][-a.tail:])
        rows.append({"contender": name, "iter_s": statistics.median(r["iter_s"][skip:]),
                     "step_s": statistics.median(r["step_s"][skip:]), "cpu_s": statistics.median(r["cpu_s"][skip:]),
                     "first_loss": r["losses"][0], "tail_loss": tail, "gap_vs_first": tail / base - 1.0})
    if a.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(f"model {a.model}, world 2, ZeRO-2 (the -z3 / super contenders: ZeRO-3, no clipping), micro-batch {a.micro}, {a.rounds} rounds x {a.round_steps} steps "
          f"(interleaved), zenflow topk {a.topk} update {a.update} select {a.select}")
    print(f"{'contender':<16}{'iter s':>9}{'step s':>9}{'cpu s':>9}{'first':>8}{'tail loss':>11}{'gap':>8}")
    for row in rows:
        print(f"{row['contender']:<16}{row['iter_s']:>9.4f}{row['step_s']:>9.4f}{row['cpu_s']:>9.4f}"
              f"{row['first_loss']:>8.3f}{row['tail_loss']:>11.4f}{row['gap_vs_first']:>+8.1%}")


if __name__ == "__main__":
    main()
