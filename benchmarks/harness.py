"""One benchmark harness: every contender trains the same model, on the same data, from the same seed.

Each contender runs in its own set of Gloo ranks forked from this (warm) process by
``zerospeed.testing.run_distributed``. A rank builds ``GPT(preset, seed)``, precomputes its share of every
global batch (drawn from the bundled corpus by a seeded generator, so all contenders see identical data),
runs ``warmup`` untimed optimizer steps, then ``steps`` timed ones, recording per step the wall time
(``perf_counter``) and this process's CPU time (``process_time``, all threads). Reported per contender:
median wall seconds/step (max over ranks), CPU seconds/step (summed over ranks), global tokens/s, per-rank
peak RSS and model-state bytes, and the last loss (a sanity check: the math is the same for all).
With ``repeat > 1`` contenders run interleaved ``repeat`` times and the median round is kept, which damps
noise from other work on a shared machine.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from zerospeed.data import ByteDataset
from zerospeed.models import GPT, PRESETS
from zerospeed.testing import run_distributed

try:  # run as ``python benchmarks/bench_x.py`` (script dir on sys.path) or as a package module
    from contenders import Batch, BenchSpec, Contender, world_of
except ImportError:  # pragma: no cover
    from benchmarks.contenders import Batch, BenchSpec, Contender, world_of

MiB = 1024 * 1024


@dataclass
class Result:
    """One contender's figures (a row of the table, a line of ``--json``)."""

    contender: str
    world_size: int
    threads: int
    wall_s_per_step: float
    cpu_s_per_step: float
    tokens_per_s: float
    peak_rss_mib: float  # max over ranks
    start_rss_mib: float  # RSS when the rank began (interpreter + torch, shared with the parent after fork)
    state_mib: float  # model-state bytes held per rank (max over ranks)
    state_detail: dict[str, float]
    last_loss: float
    ratio: float | None = None  # wall s/step over the baseline's in the same round (median over rounds)
    cpu_ratio: float | None = None  # the same for CPU s/step
    cpu_ratios: list[float] | None = None  # every round's paired CPU ratio, in round order (the spread behind the median)
    comm_bytes_per_step: int | None = None  # bytes a rank communicated in the last step (max over ranks), if counted
    peak_device_mib: float | None = None  # CUDA: peak allocated device memory (max over ranks)


def rank_batches(spec: BenchSpec, rank: int, world: int) -> list[list[Batch]]:
    """This rank's micro-batches for every step: the global batch split evenly, in rank order."""
    cfg = PRESETS[spec.preset]()
    data = ByteDataset(cfg.block_size, "train")
    n_micro = spec.global_micro_batches()
    if n_micro % world:
        raise ValueError(f"{n_micro} global micro-batches do not split over {world} ranks")
    per_rank = n_micro // world
    steps = []
    for step in range(spec.warmup + spec.steps):
        gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + step)
        idx = torch.randint(len(data), (n_micro * spec.micro_batch,), generator=gen).view(n_micro, spec.micro_batch)
        mine = idx[rank * per_rank : (rank + 1) * per_rank]
        steps.append([tuple(torch.stack(t) for t in zip(*(data[int(i)] for i in row))) for row in mine])
    return steps  # type: ignore[return-value]


def _rank_main(spec: BenchSpec, contender: Contender) -> dict[str, Any]:
    """Runs inside each forked rank."""
    from zerospeed import comm

    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    torch.set_num_threads(contender.threads)
    rank, world = comm.get_rank(), comm.get_world_size()
    batches = rank_batches(spec, rank, world)
    if spec.device == "cuda":  # the harness's NCCL ranks each hold one device
        dev = torch.device("cuda", torch.cuda.current_device())
        batches = [[(x.to(dev), y.to(dev)) for x, y in step] for step in batches]
    torch.manual_seed(spec.seed)
    trainer = contender.make(GPT(PRESETS[spec.preset](), seed=spec.seed), spec)
    walls, cpus, losses = [], [], []
    for i, step_batches in enumerate(batches):
        comm.barrier()  # every rank starts the step together, so wall time is the step's, not a straggler's
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(trainer.step(step_batches))
        if i >= spec.warmup:
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    return {
        "wall": statistics.median(walls),
        "cpu": statistics.median(cpus),
        "loss": losses[-1],
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux reports KiB
        "start_rss": start_rss,
        "state": trainer.state_bytes(),
        "comm": trainer.comm_bytes() if hasattr(trainer, "comm_bytes") else None,
        "peak_device": torch.cuda.max_memory_allocated() if spec.device == "cuda" else None,
    }


def run_contender(spec: BenchSpec, contender: Contender, timeout: float = 1800.0) -> Result:
    world = world_of(contender, spec)
    per_rank = run_distributed(_rank_main, world, spec, contender, timeout=timeout,
                               backend="nccl" if spec.device == "cuda" else "gloo")
    cfg = PRESETS[spec.preset]()
    wall = max(r["wall"] for r in per_rank)
    tokens = spec.global_micro_batches() * spec.micro_batch * cfg.block_size
    state = max(per_rank, key=lambda r: r["state"].get("total", 0))["state"]
    return Result(
        contender=contender.name,
        world_size=world,
        threads=contender.threads,
        wall_s_per_step=wall,
        cpu_s_per_step=sum(r["cpu"] for r in per_rank),
        tokens_per_s=tokens / wall,
        peak_rss_mib=max(r["peak_rss"] for r in per_rank) / MiB,
        start_rss_mib=max(r["start_rss"] for r in per_rank) / MiB,
        state_mib=state.get("total", 0) / MiB,
        state_detail={k: v / MiB for k, v in state.items()},
        last_loss=sum(r["loss"] for r in per_rank) / len(per_rank),
        comm_bytes_per_step=None if per_rank[0]["comm"] is None else max(r["comm"] for r in per_rank),
        peak_device_mib=None if per_rank[0]["peak_device"] is None else max(r["peak_device"] for r in per_rank) / MiB,
    )


def runnable_contenders(contenders: list[Contender]) -> list[Contender]:
    """The contenders that can run here; each one that cannot prints why it is skipped."""
    runnable = []
    for c in contenders:
        reason = c.skip()
        if reason:
            print(f"skipping {c.name}: {reason}", flush=True)
        else:
            runnable.append(c)
    return runnable


def run_all(spec: BenchSpec, contenders: list[Contender], baseline: str | None = None, repeat: int = 1,
            log: bool = True) -> list[Result]:
    """Run every runnable contender ``repeat`` times interleaved; keep each one's median-wall round.

    Every other round runs the contenders in reverse order, so a machine that drifts within a round (it slows
    down or speeds up) weighs on the first and the last contenders alike instead of always on the later ones."""
    runnable = runnable_contenders(contenders)
    rounds: dict[str, list[Result]] = {c.name: [] for c in runnable}
    for r in range(repeat):
        for c in runnable if r % 2 == 0 else runnable[::-1]:
            res = run_contender(spec, c)
            rounds[c.name].append(res)
            if log:
                print(f"  round {r + 1}/{repeat} {c.name}: {res.wall_s_per_step:.3f} s/step", flush=True)
    results = [sorted(rs, key=lambda x: x.wall_s_per_step)[len(rs) // 2] for rs in rounds.values()]
    if baseline in rounds:  # paired ratios: each round's figure over the baseline's from the same round
        for res in results:
            pairs = list(zip(rounds[res.contender], rounds[baseline]))
            res.ratio = statistics.median(a.wall_s_per_step / b.wall_s_per_step for a, b in pairs)
            res.cpu_ratios = [a.cpu_s_per_step / b.cpu_s_per_step for a, b in pairs]
            res.cpu_ratio = statistics.median(res.cpu_ratios)
    return results


def format_table(spec: BenchSpec, results: list[Result], baseline: str | None = None) -> str:
    cfg = PRESETS[spec.preset]()
    n = GPT(cfg).num_params()
    head = (
        f"GPT[{spec.preset}] {n / 1e6:.2f}M params, seq {cfg.block_size}, global batch "
        f"{spec.global_micro_batches() * spec.micro_batch} sequences (micro {spec.micro_batch}), fp32 AdamW, "
        f"{spec.warmup} warm-up + {spec.steps} timed steps, torch {torch.__version__}"
    )
    vs = f" vs {baseline}" if baseline else " ratio"
    cols = ["contender", "ranks", "thr", "wall s/step", "cpu s/step", "tokens/s", "wall" + vs, "cpu" + vs,
            "peak RSS MiB/rank", "state MiB/rank", "last loss"]
    fmt = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    rows = [[r.contender, str(r.world_size), str(r.threads), f"{r.wall_s_per_step:.3f}", f"{r.cpu_s_per_step:.3f}",
             f"{r.tokens_per_s:,.0f}", fmt(r.ratio), fmt(r.cpu_ratio), f"{r.peak_rss_mib:.0f}",
             f"{r.state_mib:.1f}", f"{r.last_loss:.4f}"] for r in results]
    widths = [max(len(x) for x in col) for col in zip(cols, *rows)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([head, "", line(cols), sep, *(line(r) for r in rows)])


def emit(spec: BenchSpec, results: list[Result], as_json: bool, baseline: str | None, bench: str) -> None:
    """Print the table, or one JSON object per contender."""
    if as_json:
        for r in results:
            print(json.dumps({"bench": bench, **asdict(spec), **asdict(r)}))
    else:
        print(format_table(spec, results, baseline))
