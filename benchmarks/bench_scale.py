"""Scale: a GPT whose fp32 training state (16Ψ) is ~2.5x a per-rank memory budget B trains under ZeRO-3.

    .venv/bin/python benchmarks/bench_scale.py [--world 4] [--budget-mib B] [--steps 8] [--json]

Every rank builds the model inside ``zerospeed.zero.Init`` (it is cut while it is built, so no rank ever
holds it whole), then trains it with ZeRO stage 3 for ``--steps`` optimizer steps on the bundled corpus
(fp32 AdamW). Reported per rank: model-state bytes (``engine.memory_breakdown()``) against B and against
the stage-3 formula 16Ψ/N, peak RSS over the RSS the rank started with, bytes communicated per step, and
the losses, which should fall. For contrast, stage 0 (plain data parallelism) needs 16Ψ per rank, more
than B; ``--stage0-steps`` (default 2) runs it too, to measure that rather than only compute it.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from typing import Any

import torch

from zerospeed.data import ByteDataset
from zerospeed.models import GPT, GPTConfig
from zerospeed.testing import run_distributed

MiB = 1024 * 1024


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _batches(cfg: GPTConfig, micro: int, steps: int, rank: int, world: int, seed: int) -> list[tuple[Any, Any]]:
    """This rank's micro-batch for every step (the global batch is ``world`` micro-batches)."""
    data = ByteDataset(cfg.block_size, "train")
    out = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        idx = torch.randint(len(data), (world * micro,), generator=gen)[rank * micro: (rank + 1) * micro]
        x, y = zip(*(data[int(i)] for i in idx))
        out.append((torch.stack(x), torch.stack(y)))
    return out


@torch.no_grad()
def _seeded_init(model: GPT, seed: int) -> None:
    """``GPT.reset_parameters`` for a model built under ``zero.Init``: each parameter gathered in turn.

    (Written directly, the draws would land in the empty placeholders of the cut parameters.)
    """
    import math

    from zerospeed.zero import GatheredParameters

    gen = torch.Generator(device="cpu").manual_seed(seed)
    resid_std = 0.02 / math.sqrt(2 * model.config.n_layer)
    for name, p in model.named_parameters():
        with GatheredParameters([p], modifier_rank=0):
            if p.dim() < 2:
                p.fill_(1.0 if "ln" in name and name.endswith("weight") else 0.0)
                continue
            std = resid_std if name.endswith("proj.weight") else 0.02
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))


def _rank_main(cfg: GPTConfig, stage: int, micro: int, steps: int, lr: float, seed: int,
               bucket: int) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm

    start_rss = _rss_now()
    rank, world = comm.get_rank(), comm.get_world_size()
    batches = _batches(cfg, micro, steps, rank, world, seed)
    config = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        # Transient buffers bounded by ``bucket`` elements: gradient buckets, prefetched and live parameters.
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                              "stage3_prefetch_bucket_size": bucket, "stage3_max_live_parameters": bucket},
    }
    if stage == 3:
        with zerospeed.zero.Init(config_dict_or_path=config):
            model = GPT(cfg, seed=seed)
        _seeded_init(model, seed)
    else:
        model = GPT(cfg, seed=seed)
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses, walls, comm_bytes = [], [], []
    for x, y in batches:
        comm.barrier()
        t0 = time.perf_counter()
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        walls.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        comm_bytes.append(engine.last_step_comm_volume)
    mean = torch.tensor(losses)
    comm.all_reduce(mean)  # the global batch's loss: mean over ranks
    return {"losses": (mean / world).tolist(), "walls": walls, "comm": comm_bytes[-1],
            "state": engine.memory_breakdown(), "start_rss": start_rss,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run(cfg: GPTConfig, stage: int, world: int, micro: int, steps: int, lr: float, seed: int,
        bucket: int) -> dict[str, Any]:
    ranks = run_distributed(_rank_main, world, cfg, stage, micro, steps, lr, seed, bucket, timeout=1800.0)
    worst = max(ranks, key=lambda r: r["state"]["total"])
    return {"stage": stage, "world": world, "losses": ranks[0]["losses"],
            "s_per_step": sorted(max(w) for w in zip(*(r["walls"] for r in ranks)))[steps // 2],
            "state": worst["state"], "comm": max(r["comm"] for r in ranks),
            "peak_over_start": max(r["peak_rss"] - r["start_rss"] for r in ranks),
            "peak_rss": max(r["peak_rss"] for r in ranks), "start_rss": max(r["start_rss"] for r in ranks)}


def report(cfg: GPTConfig, psi: int, budget: int, micro: int, bucket: int, runs: list[dict[str, Any]]) -> str:
    lines = [f"GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} seq {cfg.block_size}: Ψ = {psi:,} parameters; "
             f"fp32 training state 16Ψ = {16 * psi / MiB:.1f} MiB; budget B = {budget / MiB:.1f} MiB per rank "
             f"(16Ψ = {16 * psi / budget:.2f} B); micro-batch {micro} per rank, fp32 AdamW, torch {torch.__version__}",
             ""]
    cols = ["stage", "ranks", "formula", "theory MiB/rank", "state MiB/rank", "state / B", "fits B",
            "peak RSS - start MiB", "comm/step (Ψ)", "s/step", "loss first -> last"]
    body = []
    for r in runs:
        n = r["world"]
        formula, theory = ("16Ψ/N", 16 * psi / n) if r["stage"] == 3 else ("16Ψ", 16 * psi)
        st = r["state"]["total"]
        body.append([str(r["stage"]), str(n), formula, f"{theory / MiB:.1f}", f"{st / MiB:.1f}", f"{st / budget:.2f}",
                     "yes" if st <= budget else "NO", f"{r['peak_over_start'] / MiB:.0f}",
                     f"{r['comm'] / (4 * psi):.2f}", f"{r['s_per_step']:.2f}",
                     f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}"])
    widths = [max(len(x) for x in col) for col in zip(cols, *body)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    lines += [line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(b) for b in body), ""]
    for r in runs:
        detail = ", ".join(f"{k} {v / MiB:.1f}" for k, v in r["state"].items() if k not in ("total", "model_states"))
        lines.append(f"stage {r['stage']} state per rank (MiB): {detail}")
        lines.append(f"stage {r['stage']} losses: " + " ".join(f"{x:.3f}" for x in r["losses"]))
    lines.append(f"buckets (reduce, all-gather, stage-3 prefetch and live parameters): {bucket:,} elements")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--budget-mib", type=float, default=None, help="per-rank budget B (default: 16Ψ / 2.5)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--stage0-steps", type=int, default=2, help="also run stage 0 this many steps (0: skip)")
    p.add_argument("--bucket-mib", type=float, default=None,
                   help="cap of each transient buffer: reduce/all-gather buckets, prefetch, live params (default B/8)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    cfg = GPTConfig(block_size=args.seq, n_layer=args.n_layer, n_head=8, n_embd=args.n_embd)
    psi = GPT(cfg).num_params()
    budget = int(args.budget_mib * MiB) if args.budget_mib else int(16 * psi / 2.5)
    bucket = int((args.bucket_mib * MiB if args.bucket_mib else budget / 8) // 4)  # fp32 elements
    runs = [run(cfg, 3, args.world, args.micro_batch, args.steps, args.lr, args.seed, bucket)]
    if args.stage0_steps:
        runs.append(run(cfg, 0, args.world, args.micro_batch, args.stage0_steps, args.lr, args.seed, bucket))
    if args.json:
        for r in runs:
            print(json.dumps({"bench": "scale", "psi": psi, "budget": budget, "bucket": bucket, **r}))
    else:
        print(report(cfg, psi, budget, args.micro_batch, bucket, runs))


if __name__ == "__main__":
    main()
