"""A/B of two zerospeed source trees on ``bench_serving.py``'s zerospeed contender, in one process (CPU seconds).

    git archive main src | tar -x -C /tmp/old_serve
    .venv/bin/python benchmarks/ab_serving.py --old /tmp/old_serve/src [--rounds 10] [--requests 48]

The old tree's ``zerospeed`` package is copied to a temporary directory as ``zerospeed_old`` (its imports
rewritten), so both engines run in the same process on the same model and workload (``--rate 0``: all requests
at once, greedy, the benchmark's budget 256 and block 16). Rounds alternate the order (old, new / new, old);
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


def run(inference, model, reqs, budget: int) -> dict[int, list[int]]:
    """Every request of ``reqs`` through a fresh ``ServingEngine`` of module ``inference``; tokens per request."""
    block = 16
    blocks = sum(math.ceil((len(p) + o) / block) for _, p, o in reqs)
    cfg = {"state_manager": {"max_ragged_batch_size": budget, "max_ragged_sequence_count": len(reqs),
                             "max_tracked_sequences": len(reqs), "max_context": 2048, "kv_block_size": block,
                             "memory_config": {"mode": "allocate", "size": blocks}}}
    eng = inference.ServingEngine(model, cfg)
    tokens: dict[int, list[int]] = {}
    for _, p, o in reqs:
        tokens[eng.add_request(p, inference.SamplingParams(max_tokens=o))] = []
    while eng.has_work:
        for ev in eng.step():
            tokens[ev.uid].append(ev.token)
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="the old tree's src/ directory (git archive ... src)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--budget", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="ab_serving_"))
    renamed_copy(Path(args.old), tmp)
    sys.path.insert(0, str(tmp))
    import zerospeed.inference as new
    import zerospeed_old.inference as old

    model = bench.build("llama")
    reqs = bench.workload(args.requests, 0, (16, 256), (16, 128), 0)
    for side in (old, new):  # warm-up, untimed
        run(side, model, reqs[:8], args.budget)
    if run(old, model, reqs, args.budget) != run(new, model, reqs, args.budget):
        raise SystemExit("the two trees produce different tokens")
    cpu: dict[str, list[float]] = {"old": [], "new": []}
    for k in range(args.rounds):
        for name in (("old", "new") if k % 2 == 0 else ("new", "old")):
            c0 = time.process_time()
            run(old if name == "old" else new, model, reqs, args.budget)
            cpu[name].append(time.process_time() - c0)
    shutil.rmtree(tmp, ignore_errors=True)
    for name, xs in cpu.items():
        print(f"{name}: CPU s median {statistics.median(xs):.4f} min {min(xs):.4f} ({len(xs)} runs)")
    paired = [b / a for a, b in zip(cpu["old"], cpu["new"])]
    print(f"new/old: medians {statistics.median(cpu['new']) / statistics.median(cpu['old']):.3f}, mins "
          f"{min(cpu['new']) / min(cpu['old']):.3f}, paired per round {statistics.median(paired):.3f}; "
          f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
