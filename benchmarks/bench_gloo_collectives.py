"""Gloo's own reduce-scatter / all-gather against zerospeed's (one reduce / broadcast per rank), and the
all-reduce that DDP uses, on host tensors: milliseconds per call, median of ``--repeat`` (world ranks, forked).

    PYTHONPATH=src python benchmarks/bench_gloo_collectives.py [--world 2] [--numel 27000000 3000000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch


def _rank(numels: list[int], repeat: int) -> dict[str, Any]:
    import torch.distributed as dist  # the benchmark measures torch's own calls beside zerospeed's

    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    res: dict[str, Any] = {}
    for n in numels:
        n -= n % world
        x, part, full = torch.randn(n), torch.empty(n // world), torch.empty(n)
        cases = {
            "all_reduce (torch)": lambda: dist.all_reduce(x),
            "reduce_scatter (torch)": lambda: dist.reduce_scatter_single(part, x),
            "reduce_scatter (zerospeed)": lambda: comm.reduce_scatter(part, x),
            "reduce_scatter (zerospeed, scratch)": lambda: comm.reduce_scatter(part, x, scratch=True),  # a pair exchange at world 2
            "all_gather (torch)": lambda: dist.all_gather_single(full, part),
            "all_gather (zerospeed)": lambda: comm.all_gather(full, part),
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(repeat):
            for name, fn in cases.items():
                comm.barrier()
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        res[str(n)] = {k: statistics.median(v) for k, v in times.items()}
    return res if rank == 0 else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--numel", type=int, nargs="+", default=[27_000_000, 3_000_000])
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    from zerospeed.testing import run_distributed

    out = run_distributed(_rank, a.world, a.numel, a.repeat, timeout=600)[0]
    for n, row in out.items():
        print(f"{int(n):,} fp32 elements ({int(n) * 4 / 2**20:.0f} MiB), world {a.world}, ms per call (median of {a.repeat}):")
        for k, v in row.items():
            print(f"  {k:38s} {v:8.1f}")


if __name__ == "__main__":
    main()
