"""A/B of two zerospeed source trees on ``bench_serving.py``'s zerospeed contender, in one process (CPU seconds).

    git archive main src | tar -x -C /tmp/old_serve
    .venv/bin/python benchmarks/ab_serving.py --old /tmp/old_serve/src [--rounds 10] [--requests 48] [--rate 8]

The old tree's ``zerospeed`` package is copied to a temporary directory as ``zerospeed_old`` (its imports
rewritten), so both engines run in the same process on the same model and workload (``--rate 0``: all requests
at once, or ``--rate`` Poisson arrivals in real time, then TTFT / TPOT p50 too; greedy, the benchmark's budget 256
and block 16). Rounds alternate the order (old, new / new, old);
each run is timed by ``time.process_time``. Separate processes per side were too noisy on a shared machine
(one process's memory layout and placement against the other's); here both sides share them. The greedy
tokens of both trees must be equal (checked once before timing).
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_serving as bench  # noqa: E402


def renamed_copy(src: Path, into: Path) -> None:
    """``src/zerospeed`` as ``into/zerospeed_old``, with its own imports pointing at the copy."""
    shutil.copytree(src / "zerospeed", into / "zerospeed_old")
    for f in (into / "zerospeed_old").rglob("*.py"):
        text = re.sub(r"\b(from|import) zerospeed\b", r"\1 zerospeed_old", f.read_text())
        f.write_text(re.sub(r"\bzerospeed\.(?=[A-Za-z_])", "zerospeed_old.", text))


def run(inference, model, reqs, budget: int, stats: dict | None = None) -> dict[int, list[int]]:
    """Every request of ``reqs`` through a fresh ``ServingEngine`` of module ``inference``; tokens per request.
    Requests are added at their arrival times (real time) and, with ``stats``, TTFT / TPOT p50 are put there."""
    block = 16
    blocks = sum(math.ceil((len(p) + o) / block) for _, p, o in reqs)
    cfg = {"state_manager": {"max_ragged_batch_size": budget, "max_ragged_sequence_count": len(reqs),
                             "max_tracked_sequences": len(reqs), "max_context": 2048, "kv_block_size": block,
                             "memory_config": {"mode": "allocate", "size": blocks}}}
    eng = inference.ServingEngine(model, cfg)
    tokens: dict[int, list[int]] = {}
    times: dict[int, list[float]] = {}
    t0, nxt = time.perf_counter(), 0
    while nxt < len(reqs) or eng.has_work:
        while nxt < len(reqs) and reqs[nxt][0] <= time.perf_counter() - t0:
            uid = eng.add_request(reqs[nxt][1], inference.SamplingParams(max_tokens=reqs[nxt][2]))
            tokens[uid], times[uid] = [], []
            nxt += 1
        if not eng.has_work:
            bench.wait_until(t0, reqs[nxt][0])
            continue
        for ev in eng.step():
            tokens[ev.uid].append(ev.token)
            times[ev.uid].append(time.perf_counter() - t0)
    if stats is not None:
        order = sorted(times)  # uids in arrival order
        s = bench.summarize(reqs, dict(enumerate(times[u] for u in order)), dict(enumerate(tokens[u] for u in order)),
                            None)
        stats.update(ttft=s["ttft_p50"], tpot=s["tpot_p50"])
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="the old tree's src/ directory (git archive ... src)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="ab_serving_"))
    renamed_copy(Path(args.old), tmp)
    sys.path.insert(0, str(tmp))
    import zerospeed.inference as new
    import zerospeed_old.inference as old

    model = bench.build("llama")
    reqs = bench.workload(args.requests, args.rate, (16, 256), (16, 128), 0)
    for side in (old, new):  # warm-up, untimed
        run(side, model, [(0.0, p, o) for _, p, o in reqs[:8]], args.budget)
    if run(old, model, reqs, args.budget) != run(new, model, reqs, args.budget):
        raise SystemExit("the two trees produce different tokens")
    cpu: dict[str, list[float]] = {"old": [], "new": []}
    lat: dict[str, list[dict]] = {"old": [], "new": []}
    for k in range(args.rounds):
        for name in (("old", "new") if k % 2 == 0 else ("new", "old")):
            c0 = time.process_time()
            lat[name].append({})
            run(old if name == "old" else new, model, reqs, args.budget, lat[name][-1])
            cpu[name].append(time.process_time() - c0)
    shutil.rmtree(tmp, ignore_errors=True)
    for name, xs in cpu.items():
        print(f"{name}: CPU s median {statistics.median(xs):.4f} min {min(xs):.4f} ({len(xs)} runs); TTFT p50 "
              f"median {statistics.median(r['ttft'] for r in lat[name]):.4f} s, TPOT p50 median "
              f"{1000 * statistics.median(r['tpot'] for r in lat[name]):.2f} ms")
    paired = [b / a for a, b in zip(cpu["old"], cpu["new"])]
    print(f"new/old: medians {statistics.median(cpu['new']) / statistics.median(cpu['old']):.3f}, mins "
          f"{min(cpu['new']) / min(cpu['old']):.3f}, paired per round {statistics.median(paired):.3f}; "
          f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
