"""Which tensors are alive at the peak of one training step: eager ZeRO-3 vs DeepCompile ZeRO-3 (rank 0).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_compile_memory.py [--preset gpt2-small] [--micro-batch 2]

World 2 (Gloo, CPU), ``aot_eager``, default ZeRO-3 settings. Two steps run first (compilation, optimizer
state); the third is recorded with ``torch.profiler`` (``profile_memory``). From its allocation events the
script replays the bytes allocated in the step, finds the peak, and groups the allocations alive at that
moment by the op that made them (and its callers): the difference between the two tables is what one mode
holds at its peak that the other does not. Tensor bytes only (not the allocator's or the compiler's memory).
"""

from __future__ import annotations

import argparse
import collections
import resource
from typing import Any

import torch

import zerospeed
from zerospeed.models import GPT, PRESETS
from zerospeed.testing import run_distributed


def _peak_live(prof: Any) -> tuple[float, list[tuple[float, int, str]]]:
    """(peak MiB allocated in the profiled step, [(MiB, count, 'op [callers]')] alive at that peak)."""
    from torch._C._profiler import _EventType
    from torch.profiler._memory_profiler import OpTree

    live: dict[int, tuple[int, str]] = {}
    cur = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for node in OpTree(prof.profiler.kineto_results).sorted_nodes:
        if node.typed[0] != _EventType.Allocation:
            continue
        alloc = node.typed[1]
        names, p = [], node.parent
        while p is not None and len(names) < 4:
            names.append(p.name)
            p = p.parent
        if alloc.alloc_size > 0:
            live[alloc.ptr] = (alloc.alloc_size, f"{names[0] if names else '?'} [{' < '.join(names[1:])[:100]}]")
        else:
            live.pop(alloc.ptr, None)
        cur += alloc.alloc_size
        if cur > peak:
            peak, at_peak = cur, dict(live)
    sizes: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for size, where in at_peak.values():
        sizes[where] += size
        counts[where] += 1
    return peak / 2 ** 20, [(v / 2 ** 20, counts[k], k) for k, v in sizes.most_common(20)]


def _rank(deep: bool, preset: str, micro_batch: int) -> dict[str, Any] | None:
    torch._dynamo.reset()
    cfg = PRESETS[preset]()
    model = GPT(cfg, seed=0)
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 3},
              "compile": {"deepcompile": deep}}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if deep:
        engine.compile(backend="aot_eager")
    gen = torch.Generator().manual_seed(engine.global_rank)

    def step() -> None:
        b = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.block_size + 1), generator=gen)
        _, loss = engine(b[:, :-1], b[:, 1:])
        engine.backward(loss)
        engine.step()

    step()
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    if engine.global_rank != 0:
        return None
    peak, top = _peak_live(prof)
    return {"peak_mib": peak, "top": top, "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-small", choices=sorted(PRESETS))
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()
    for deep in (False, True):
        r = run_distributed(_rank, 2, deep, args.preset, args.micro_batch, timeout=3600)[0]
        print(f"{'DeepCompile' if deep else 'eager'} ZeRO-3: {r['peak_mib']:.1f} MiB allocated in the step at its "
              f"peak (rank 0; ru_maxrss {r['rss_gib']:.2f} GiB, profiler included)")
        for mib, count, where in r["top"]:
            print(f"  {mib:8.1f} MiB  x{count:<4d} {where}")


if __name__ == "__main__":
    main()
