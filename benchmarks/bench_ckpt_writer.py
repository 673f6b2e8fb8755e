"""Checkpoint writer throughput: today's inline writer against ``checkpoint.writer: {"type": "fast"}``.

One rank's checkpoint file of ``--gib`` GiB (fp32 tensors of 64 Mi elements, as the ZeRO shards and optimizer
moments of a large partition are) is written with ``write_tensors`` (what ``save_checkpoint`` calls for each
file: header, bytes, sha256, fsync) by each writer in turn, alternating, ``--rounds`` times; each figure is
wall seconds from open to fsync. The page cache is dropped between writes where allowed (else noted).

    python benchmarks/bench_ckpt_writer.py [--gib 1] [--rounds 2] [--dir /tmp] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch

from zerospeed.config import load_config
from zerospeed.runtime.checkpoint.tensor_file import write_tensors


def _writers() -> dict[str, object]:
    fast = load_config({"train_batch_size": 1, "checkpoint": {"writer": {"type": "fast"}}}).checkpoint.writer
    single = load_config({"train_batch_size": 1, "checkpoint": {"writer": {"type": "fast", "io_buffer_double": False}}}
                         ).checkpoint.writer
    return {"inline (today)": None, "fast (double buffer)": fast, "fast (single buffer)": single}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    per = 64 * 1024 * 1024  # elements per tensor (256 MiB)
    count = max(1, round(a.gib * 1024 ** 3 / (per * 4)))
    g = torch.Generator().manual_seed(0)
    tensors = {f"master/p{i}": torch.randn(per, generator=g) for i in range(count)}
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    work = tempfile.mkdtemp(dir=a.dir, prefix="zs-writer-")
    rows: dict[str, list[float]] = {name: [] for name in _writers()}
    digests: set[str] = set()
    try:
        for _ in range(a.rounds):
            for name, cfg in _writers().items():
                path = os.path.join(work, "shard.safetensors")
                t0 = time.perf_counter()
                size, digest = write_tensors(path, tensors, {"format": "pt"}, cfg)
                rows[name].append(time.perf_counter() - t0)
                digests.add(digest)
                os.remove(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert len(digests) == 1, "the writers must produce the same file"
    out = {name: {"seconds": s, "GB/s": [nbytes / x / 1e9 for x in s]} for name, s in rows.items()}
    if a.json:
        print(json.dumps({"bytes": nbytes, "rows": out}))
        return
    print(f"{nbytes / 1024 ** 3:.2f} GiB per file, {a.rounds} rounds, cores {os.cpu_count()}")
    print("| writer | seconds per round | GB/s per round |\n|---|---|---|")
    for name, r in out.items():
        print(f"| {name} | {', '.join(f'{x:.2f}' for x in r['seconds'])} | "
              f"{', '.join(f'{x:.2f}' for x in r['GB/s'])} |")


if __name__ == "__main__":
    main()
