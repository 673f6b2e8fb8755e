"""Pipeline parallelism: zerospeed's PipelineEngine vs DeepSpeed's on the same layer list, in the same run.

Contenders (each in its own forked Gloo ranks, same layers, same data, same seeds):
  zerospeed pp=2, zerospeed pp=2 x dp=2, and DeepSpeed's PipelineEngine at the same shapes when
  ``deepspeed`` is importable (run with its venv: ``/tmp/dsvenv/bin/python``; ``DS_ACCELERATOR=cpu``).
Reported per contender: median wall seconds per ``train_batch`` (max over ranks), peak RSS per rank, the
last loss (a sanity check), and for zerospeed the *measured* bubble: each stage's idle share of its
pipeline's span (``accounting.pipeline_bubble``: 1 - the stage's forward+backward seconds / the longest
span to a last forward/backward among the pipeline's stages, the definition behind (p-1)/(m+p-1)), per
stage and its mean, next to the theory and to the bubble 1F1B implies for the measured per-stage
forward/backward times (``simulate``: stage imbalance included, machine noise excluded), the per-stage
forward+backward seconds per micro-batch (equal stages are the theory's premise) and the p2p bytes per
step. Layers: a GPT (tied embedding/head) split by ``type:Block``; a small ``--vocab`` keeps the last
stage's head and loss cheap, so the stages are balanced, and a large ``--embd``/``--seq`` keeps p2p latency
small against compute:

    python benchmarks/bench_pipeline.py --embd 512 --seq 256 --vocab 64 --micro-batches 8 --no-dp [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zerospeed.models.gpt import Block, GPTConfig  # noqa: E402
from zerospeed.profiling.memory import peak_rss_bytes  # noqa: E402
from zerospeed.testing import run_distributed  # noqa: E402

MiB = 1024 * 1024


class Embed(nn.Module):
    def __init__(self, vocab: int, block: int, dim: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))


def head(embed: Embed, x: torch.Tensor) -> torch.Tensor:
    return x @ embed.wte.weight.t()


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def layers(api: Any, cfg: GPTConfig) -> list[Any]:
    tie = dict(tied_weight_attr=["wte.weight"])
    return [api.TiedLayerSpec("embed", Embed, cfg.vocab_size, cfg.block_size, cfg.n_embd, **tie),
            *[api.LayerSpec(Block, cfg) for _ in range(cfg.n_layer)],
            api.LayerSpec(nn.LayerNorm, cfg.n_embd),
            api.TiedLayerSpec("embed", Embed, cfg.vocab_size, cfg.block_size, cfg.n_embd, forward_fn=head, **tie)]


def _data(cfg: GPTConfig, micro: int, count: int, steps: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, cfg.vocab_size, (steps, count, micro, cfg.block_size + 1), generator=g)


def _seed(seed: Any) -> None:
    torch.manual_seed(int(seed))  # DeepSpeed hands numpy integers here (its random.seed path rejects them)


def _pin_to_core(rank: int) -> None:
    """Every thread of this rank (Gloo's included) on core ``rank``: stops the OS from moving the two stages
    between cores, one source of micro-batch-to-micro-batch jitter that the 1F1B steady state pays twice."""
    cpus = sorted(os.sched_getaffinity(0))
    core = {cpus[rank % len(cpus)]}
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), core)


def _rank(framework: str, pp: int, cfg: GPTConfig, micro: int, gas: int, warmup: int, steps: int,
          virtual: int = 1, pin: bool = False) -> dict:
    world = int(os.environ["WORLD_SIZE"])
    if pin:
        _pin_to_core(int(os.environ["RANK"]))
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "steps_per_print": 10**9,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}
    if framework == "deepspeed":
        import warnings

        import deepspeed
        import deepspeed.ops
        import deepspeed.pipe as api

        warnings.filterwarnings("ignore")
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        config["optimizer"]["params"]["torch_adam"] = True
        deepspeed.init_distributed(dist_backend="gloo")
        init = deepspeed.initialize
    else:
        import zerospeed
        import zerospeed.pipe as api

        init = zerospeed.initialize
        if framework == "zerospeed-eager":
            config["pipeline"] = {"schedule": "eager_1f1b"}
    extra = {"virtual_stages": virtual} if virtual > 1 else {}
    model = api.PipelineModule(layers(api, cfg), num_stages=pp, loss_fn=loss_fn, seed_layers=True,
                               seed_fn=_seed, partition_method="type:Block", **extra)
    engine, *_ = init(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                      config=config)
    dp_rank, dp = engine.grid.get_data_parallel_rank(), world // pp
    data = _data(cfg, micro, gas * dp, warmup + steps)

    def it():
        for s in range(data.shape[0]):
            for j in range(gas):
                w = data[s, dp_rank * gas + j]
                yield w[:, :-1], w[:, 1:]

    source = it()
    times, steps_stats = [], []
    loss = 0.0
    for s in range(warmup + steps):
        t0 = time.perf_counter()
        loss = float(engine.train_batch(source))
        if s >= warmup:
            times.append(time.perf_counter() - t0)
            steps_stats.append(getattr(engine, "last_step_stats", None))
    return {"times": times, "stats": steps_stats, "stage": engine.grid.get_pipe_parallel_rank(), "dp_rank": dp_rank,
            "rss": peak_rss_bytes(), "loss": loss}


def _bubbles(ranks: list[dict], pp: int, steps: int) -> tuple[list[float], list[float]]:
    """Per stage: the median over steps of its idle share of its pipeline's span (``pipeline_bubble``, one
    pipeline per data-parallel replica, averaged over replicas), and of its own span (the rank-local view)."""
    from zerospeed.parallel.pipeline.accounting import pipeline_bubble

    piped: list[list[float]] = [[] for _ in range(pp)]
    own: list[list[float]] = [[] for _ in range(pp)]
    for i in range(steps):
        for d in sorted({r["dp_rank"] for r in ranks}):
            stages = sorted((r for r in ranks if r["dp_rank"] == d), key=lambda r: r["stage"])
            for s, b in enumerate(pipeline_bubble([r["stats"][i] for r in stages])):
                piped[s].append(b)
                own[s].append(stages[s]["stats"][i].bubble_fraction)
    return [statistics.median(b) for b in piped], [statistics.median(b) for b in own]


def run(framework: str, pp: int, dp: int, cfg: GPTConfig, micro: int, gas: int, warmup: int, steps: int,
        virtual: int = 1, pin: bool = False) -> dict:
    ranks = run_distributed(_rank, pp * dp, framework, pp, cfg, micro, gas, warmup, steps, virtual, pin,
                            timeout=3600)
    per_step = [max(r["times"][i] for r in ranks) for i in range(steps)]
    row = {"contender": f"{framework} pp={pp} x dp={dp}" + (f" v={virtual}" if virtual > 1 else ""), "pp": pp,
           "dp": dp, "virtual": virtual, "micro_batches": gas, "s_per_step": statistics.median(per_step),
           "peak_rss_mib": max(r["rss"] for r in ranks) / MiB, "bubble_theory": (pp - 1) / (virtual * gas + pp - 1),
           "bubble_measured": None, "bubble_per_stage": None, "bubble_own_span": None, "bubble_simulated": None,
           "fwd_bwd_s_per_stage": None, "p2p_mib_per_step": None, "last_loss": ranks[0]["loss"]}
    if ranks[0]["stats"][0] is None:  # DeepSpeed: no per-step accounting
        return row
    from zerospeed.parallel.pipeline.eager import EagerTrainSchedule
    from zerospeed.parallel.pipeline.interleaved import InterleavedSchedule
    from zerospeed.parallel.pipeline.schedule import TrainSchedule
    from zerospeed.parallel.pipeline.simulate import simulate

    per_stage, own = _bubbles(ranks, pp, steps)
    by_stage = {r["stage"]: r for r in ranks if r["dp_rank"] == 0}
    fwd = [statistics.median(st.forward_seconds / gas for st in by_stage[s]["stats"]) for s in range(pp)]
    bwd = [statistics.median(st.backward_seconds / gas for st in by_stage[s]["stats"]) for s in range(pp)]
    scheds = [InterleavedSchedule(gas, pp, s, chunks=virtual) if virtual > 1 else
              EagerTrainSchedule(gas, pp, s) if framework == "zerospeed-eager" else TrainSchedule(gas, pp, s)
              for s in range(pp)]
    row.update(bubble_measured=statistics.mean(per_stage), bubble_per_stage=[round(b, 3) for b in per_stage],
               bubble_own_span=[round(b, 3) for b in own],
               bubble_simulated=statistics.mean(simulate(scheds, fwd, bwd, chunks=virtual).bubble),
               fwd_bwd_s_per_stage=[round(f + b, 4) for f, b in zip(fwd, bwd)],
               p2p_mib_per_step=max(st.p2p_bytes_sent + st.p2p_bytes_received for r in ranks for st in r["stats"]) / MiB)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batches", type=int, default=8, help="gradient_accumulation_steps (m)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256, help="a small vocabulary keeps the head+loss (last stage) cheap")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument("--no-dp", action="store_true", help="skip the pp=2 x dp=2 runs (4 ranks)")
    p.add_argument("--virtual", type=int, default=1, help="also run zerospeed interleaved with this many "
                                                              "virtual stages per rank (Megatron's schedule)")
    p.add_argument("--repeat", type=int, default=1, help="run the contenders this many times, alternating order")
    p.add_argument("--json", action="store_true")
    p.add_argument("--pin", action="store_true", help="pin rank r (all its threads) to core r")
    p.add_argument("--eager", action="store_true", help="also run zerospeed with pipeline.schedule eager_1f1b "
                                                         "(alternating with the others in every round)")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
    shapes = [(args.pp, 1)] + ([] if args.no_dp else [(args.pp, 2)])
    frameworks = ["zerospeed"] + (["zerospeed-eager"] if args.eager else [])
    if not args.no_deepspeed:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed  # noqa: F401
            frameworks.append("deepspeed")
        except Exception as exc:  # noqa: BLE001
            print(f"DeepSpeed: not importable here ({type(exc).__name__}); zerospeed only", file=sys.stderr)
    rows = []
    for pp, dp in shapes:
        rounds: dict[str, list[dict]] = {}
        for i in range(args.repeat):  # alternate who goes first: load on a shared machine drifts
            for fw in (frameworks if i % 2 == 0 else frameworks[::-1]):
                rounds.setdefault(fw, []).append(run(fw, pp, dp, cfg, args.micro_batch, args.micro_batches,
                                                     args.warmup, args.steps, pin=args.pin))
        for fw in frameworks:  # the round with the median step time
            rows.append(sorted(rounds[fw], key=lambda r: r["s_per_step"])[len(rounds[fw]) // 2])
        if args.virtual > 1 and dp == 1:
            rows.append(run("zerospeed", pp, dp, cfg, args.micro_batch, args.micro_batches, args.warmup, args.steps,
                            args.virtual, pin=args.pin))
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"GPT {args.layers} blocks, n_embd {args.embd}, seq {args.seq}, vocab {args.vocab}, micro-batch "
          f"{args.micro_batch}, m={args.micro_batches} micro-batches, fp32, ZeRO-1, 1 thread/rank")
    print(f"{'contender':<26}{'s/step':>9}{'peak RSS MiB':>14}{'bubble meas.':>14}{'simulated':>11}{'theory':>9}"
          f"{'p2p MiB':>10}{'loss':>9}  per stage: bubble / own-span bubble / fwd+bwd s")
    for r in rows:
        meas = f"{r['bubble_measured']:.3f}" if r["bubble_measured"] is not None else "-"
        p2p = f"{r['p2p_mib_per_step']:.2f}" if r["p2p_mib_per_step"] is not None else "-"
        sim = f"{r['bubble_simulated']:.3f}" if r["bubble_simulated"] is not None else "-"
        stages = (f"{r['bubble_per_stage']} / {r['bubble_own_span']} / {r['fwd_bwd_s_per_stage']}"
                  if r["bubble_per_stage"] is not None else "")
        print(f"{r['contender']:<26}{r['s_per_step']:>9.3f}{r['peak_rss_mib']:>14.0f}{meas:>14}{sim:>11}"
              f"{r['bubble_theory']:>9.3f}{p2p:>10}{r['last_loss']:>9.4f}  {stages}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
