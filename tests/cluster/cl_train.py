"""Run on every rank of a test cluster (tests/cluster): train the tiny GPT a few steps, record where it ran.

usage: cl_train.py OUT_DIR STEPS [--timeout S] [--sleep S] [--hang_rank R] [--hang_step K]

Global batch 8 (micro-batch 2), so the losses equal a 4-rank run anywhere. Rank 0 appends each step's
global mean loss to OUT_DIR/losses.jsonl; every rank writes OUT_DIR/rank<R>.json at the end of each step
(host name, the launcher's variables, the addresses of its TCP connections). ``--hang_rank R`` stops rank
R (SIGSTOP on itself) at step ``--hang_step``: a rank that never joins the next collective.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import time

import psutil
import torch

import zerospeed
from zerospeed import comm
from zerospeed.models import GPT, tiny

ENV_KEYS = ("MASTER_ADDR", "GLOO_SOCKET_IFNAME", "CL_EXPORTED", "CL_FROM_ENV_FILE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def config(timeout: float | None) -> dict:
    cfg: dict = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                 "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": 2}}
    if timeout is not None:
        cfg["comms_timeout_s"] = timeout
    return cfg


def _record(out_dir: str, rank: int, step: int) -> None:
    peers = sorted({c.raddr.ip for c in psutil.Process().net_connections(kind="tcp") if c.raddr})
    info = {"pid": os.getpid(), "host": socket.gethostname(), "step": step, "peers": peers,
            **{k: os.environ.get(k) for k in ENV_KEYS}}
    with open(os.path.join(out_dir, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(info, f)
    os.replace(os.path.join(out_dir, f"rank{rank}.json.tmp"), os.path.join(out_dir, f"rank{rank}.json"))


def train(out_dir: str, steps: int, timeout: float | None = None, sleep: float = 0.0, hang_rank: int = -1,
          hang_step: int = 1) -> list[float]:
    zerospeed.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    cfg = tiny()
    engine, *_ = zerospeed.initialize(model=GPT(cfg), config=config(timeout))
    gas, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    losses = []
    for step in range(steps):
        if rank == hang_rank and step == hang_step:
            os.kill(os.getpid(), signal.SIGSTOP)
        data = torch.randint(0, 256, (8, cfg.block_size + 1), generator=torch.Generator().manual_seed(1000 + step))
        total = torch.zeros(1)
        for i in range(gas):
            rows = data[(i * world + rank) * micro:(i * world + rank + 1) * micro]
            _, loss = engine(rows[:, :-1], rows[:, 1:])
            engine.backward(loss)
            engine.step()
            total += loss.detach() / gas
        comm.all_reduce(total)
        losses.append(total.item() / world)
        _record(out_dir, rank, step)
        if rank == 0:
            with open(os.path.join(out_dir, "losses.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "loss": losses[-1], "world": world}) + "\n")
        time.sleep(sleep)
    return losses


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("steps", type=int)
    p.add_argument("--local_rank", type=int, default=-1)  # zerospeed launch passes it, as DeepSpeed's launcher does
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--hang_rank", type=int, default=-1)
    p.add_argument("--hang_step", type=int, default=1)
    a = p.parse_args()
    train(a.out_dir, a.steps, a.timeout, a.sleep, a.hang_rank, a.hang_step)
