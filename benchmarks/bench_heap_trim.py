"""Step time with the engine's heap trimming on and off (``ZEROSPEED_TRIM_HEAP``), interleaved rounds, world 2.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_heap_trim.py [--n-layer 2] [--micro-batch 2] [--rounds 2]
        [--steps 3] [--stage 3]

A GPT of GPT-2 width (768, 12 heads, vocabulary 50257, seq 512) with ``--n-layer`` blocks, fp32 AdamW,
clipping, ``stage3_max_reuse_distance: 0``. Each round runs both settings in fresh forked Gloo ranks (the
order alternates between rounds); per setting it prints wall and CPU seconds per step (the first step, which
builds the optimizer state, left out), peak RSS, minor page faults and trims. CPU time is the figure to read
on a loaded machine; wall time only on a quiet one. The memory side is in ``bench_memory.py --trim-pairs``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from typing import Any

from zerospeed.testing import run_distributed


def rank(trim: str, n_layer: int, micro: int, steps: int, stage: int) -> dict[str, Any]:
    os.environ["ZEROSPEED_TRIM_HEAP"] = trim  # this forked rank's own environment, read by initialize()
    import torch

    import zerospeed
    from zerospeed.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=50257, block_size=512, n_layer=n_layer, n_head=12, n_embd=768), seed=0)
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
              "zero_optimization": {"stage": stage, "stage3_max_reuse_distance": 0}}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(engine.global_rank)
    walls, cpus, loss = [], [], 0.0
    for i in range(steps + 1):
        x = torch.randint(0, 256, (micro, 512), generator=gen)
        y = torch.randint(0, 256, (micro, 512), generator=gen)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        _, out = engine(x, y)
        engine.backward(out)
        engine.step()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        loss = float(out.detach())
        if i:
            walls.append(time.perf_counter() - t0)
            cpus.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
    trimmer = engine.heap_trimmer
    return {"wall": walls, "cpu": cpus, "minflt": r1.ru_minflt, "maxrss_mib": r1.ru_maxrss >> 10,
            "trims": 0 if trimmer is None else trimmer.trims, "loss": loss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    a = p.parse_args()
    res: dict[str, list[tuple[float, float]]] = {"1": [], "0": []}
    for r in range(a.rounds):
        for trim in ("1", "0") if r % 2 == 0 else ("0", "1"):
            out = run_distributed(rank, 2, trim, a.n_layer, a.micro_batch, a.steps, a.stage, timeout=3600)
            wall = sum(sum(o["wall"]) for o in out) / (2 * a.steps)
            cpu = sum(sum(o["cpu"]) for o in out) / (2 * a.steps)
            res[trim].append((wall, cpu))
            print(f"round {r + 1} trim={trim}: {wall:.3f} s/step wall, {cpu:.3f} s/step CPU, peak RSS "
                  f"{max(o['maxrss_mib'] for o in out)} MiB, minor faults {out[0]['minflt']}, trims {out[0]['trims']}, "
                  f"loss {out[0]['loss']:.4f}", flush=True)
    on, off = res["1"], res["0"]
    print(f"trim on / off, median of rounds: wall {statistics.median(x[0] / y[0] for x, y in zip(on, off)):.3f}, "
          f"CPU {statistics.median(x[1] / y[1] for x, y in zip(on, off)):.3f}")


if __name__ == "__main__":
    main()
