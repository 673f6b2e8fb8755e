"""Launched by tests/dist/test_multinode.py: train the tiny GPT with a fixed global batch of 8 sequences.

usage: mn_train.py OUT_DIR STEPS [--ckpt DIR] [--sleep S] [--fail_rank R] [--elastic]

The global batch of step s is the same whatever the world size (``train_batch_size`` 8, micro-batch 2:
accumulation = 8 / (2 * world)); rank 0 appends ``{"step", "loss", "world"}`` (the global mean loss) to
OUT_DIR/losses.jsonl. Every rank writes OUT_DIR/rank<R>.json (pid and launcher variables) at start. With
``--ckpt`` it resumes from the latest checkpoint there (universal load: any world size) and saves one
after every step. ``--fail_rank R`` makes rank R exit 1 after the first step. ``--elastic`` takes the batch
sizes from the ``elasticity`` section instead (``compute_elastic_config``: batch 8, micro-batch 2 at 1-4 ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import zerospeed
from zerospeed import comm
from zerospeed.models import GPT, tiny

GLOBAL_BATCH, MICRO = 8, 2
CONFIG = {
    "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": 2},
    "checkpoint": {"load_universal": True},
}


ELASTIC_CONFIG = {
    "elasticity": {"enabled": True, "max_train_batch_size": GLOBAL_BATCH, "micro_batch_sizes": [MICRO],
                   "min_gpus": 1, "max_gpus": 4, "version": 0.1},
    "optimizer": CONFIG["optimizer"], "zero_optimization": CONFIG["zero_optimization"],
    "checkpoint": CONFIG["checkpoint"],
}


def global_batch(step: int, block: int, size: int = GLOBAL_BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 256, (size, block + 1), generator=g)


def train(out_dir: str, steps: int, ckpt: str | None = None, sleep: float = 0.0, fail_rank: int = -1,
          load_tag: str | None = None, save: bool = True, config: dict | None = None) -> list[float]:
    """Train until ``steps`` optimizer steps are done; returns the global mean loss of each step run here.

    ``load_tag``: resume from that tag of ``ckpt`` (default: its latest); ``save``: checkpoint each step."""
    zerospeed.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    os.makedirs(out_dir, exist_ok=True)
    keys = ("LOCAL_WORLD_SIZE", "ZEROSPEED_RANKS_PER_NODE", "GROUP_RANK", "CUDA_VISIBLE_DEVICES", "MN_EXPORTED")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "world": world, **{k: os.environ.get(k) for k in keys}}, f)
    torch.manual_seed(0)
    cfg = tiny()
    engine, *_ = zerospeed.initialize(model=GPT(cfg), config=config or CONFIG)
    start = 0
    if ckpt and (load_tag or os.path.exists(os.path.join(ckpt, "latest"))):
        _, client = engine.load_checkpoint(ckpt, tag=load_tag)
        start = int(client["step"])
    gas, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    batch = engine.train_batch_size()
    assert gas * micro * world == batch
    losses = []
    for step in range(start, steps):
        data = global_batch(step, cfg.block_size, batch)
        total = torch.zeros(1)
        for i in range(gas):
            rows = data[(i * world + rank) * micro:(i * world + rank + 1) * micro]
            _, loss = engine(rows[:, :-1], rows[:, 1:])
            engine.backward(loss)
            engine.step()
            total += loss.detach() / gas
        comm.all_reduce(total)
        losses.append(total.item() / world)
        if ckpt and save:
            # a run resumed from an older tag replays the steps after it: their tags are replaced, as asked
            engine.save_checkpoint(ckpt, tag=f"step{step + 1}", client_state={"step": step + 1}, overwrite=True)
        if rank == 0:
            with open(os.path.join(out_dir, "losses.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "loss": losses[-1], "world": world, "start": start}) + "\n")
        if rank == fail_rank:
            print(f"rank {rank}: failing on purpose", file=sys.stderr, flush=True)
            sys.exit(1)
        time.sleep(sleep)
    return losses


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("steps", type=int)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--fail_rank", type=int, default=-1)
    p.add_argument("--elastic", action="store_true")
    p.add_argument("--local_rank", type=int, default=-1)  # zerospeed launch passes it (as DeepSpeed's)
    a = p.parse_args()
    train(a.out_dir, a.steps, a.ckpt, a.sleep, a.fail_rank, config=ELASTIC_CONFIG if a.elastic else None)
