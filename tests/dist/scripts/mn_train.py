"""The tiny GPT trained with a fixed global batch of 8 sequences: the one training loop of the launcher
tests (tests/dist/test_multinode.py, test_elastic_restart.py, test_launch_shutdown.py and the real
cluster's tests/cluster), run by ``zerospeed launch`` or by the forked harness (``train``).

usage: mn_train.py OUT_DIR STEPS [--ckpt DIR] [--sleep S] [--fail_rank R] [--elastic] [--timeout S]
                   [--hang_rank R] [--hang_step K]

The global batch of step s is the same whatever the world size (``train_batch_size`` 8, micro-batch 2:
accumulation = 8 / (2 * world)); rank 0 appends ``{"step", "loss", "world", "start", "time"}`` (the
global mean loss; ``time.time()``) to OUT_DIR/losses.jsonl. Every rank writes OUT_DIR/rank<R>.json at start
and after each step (pid, host name, the launcher's variables, the peer addresses of its TCP connections). With ``--ckpt`` it
resumes from the latest checkpoint there (universal load: any world size) and saves one after every step.
``--fail_rank R`` makes rank R exit 1 after the first step; ``--hang_rank R`` stops rank R (SIGSTOP on
itself) before step ``--hang_step``: a rank that never joins the next collective. ``--elastic`` takes the
batch sizes from the ``elasticity`` section instead (``compute_elastic_config``: batch 8, micro-batch 2 at
1-4 ranks). ``--timeout`` sets ``comms_timeout_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
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
ENV_KEYS = ("LOCAL_WORLD_SIZE", "ZEROSPEED_RANKS_PER_NODE", "GROUP_RANK", "CUDA_VISIBLE_DEVICES", "MN_EXPORTED",
            "MASTER_ADDR", "GLOO_SOCKET_IFNAME", "CL_EXPORTED", "CL_FROM_ENV_FILE")


def global_batch(step: int, block: int, size: int = GLOBAL_BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 256, (size, block + 1), generator=g)


def config(elastic: bool = False, timeout: float | None = None) -> dict:
    base = ELASTIC_CONFIG if elastic else CONFIG
    return base if timeout is None else {**base, "comms_timeout_s": timeout}


def _record(out_dir: str, rank: int, world: int, step: int | None) -> None:
    """This rank's rank<R>.json: where it runs, what the launcher gave it, whom it talks to (atomic)."""
    peers = sorted({c.raddr.ip for c in psutil.Process().net_connections(kind="tcp") if c.raddr})
    info = {"pid": os.getpid(), "world": world, "host": socket.gethostname(), "step": step, "peers": peers,
            **{k: os.environ.get(k) for k in ENV_KEYS}}
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)


def train(out_dir: str, steps: int, ckpt: str | None = None, sleep: float = 0.0, fail_rank: int = -1,
          load_tag: str | None = None, save: bool = True, config: dict | None = None, hang_rank: int = -1,
          hang_step: int = 1) -> list[float]:
    """Train until ``steps`` optimizer steps are done; returns the global mean loss of each step run here.

    ``load_tag``: resume from that tag of ``ckpt`` (default: its latest); ``save``: checkpoint each step."""
    zerospeed.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    os.makedirs(out_dir, exist_ok=True)
    _record(out_dir, rank, world, None)
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
        if rank == hang_rank and step == hang_step:
            os.kill(os.getpid(), signal.SIGSTOP)
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
        _record(out_dir, rank, world, step)
        if rank == 0:
            with open(os.path.join(out_dir, "losses.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "loss": losses[-1], "world": world, "start": start,
                                    "time": time.time()}) + "\n")
        if rank == fail_rank:
            print(f"rank {rank}: failing on purpose", file=sys.stderr, flush=True)
            sys.exit(1)
        time.sleep(sleep)
    return losses


def phases(path: str) -> list[list[dict]]:
    """losses.jsonl split where a (re)started group begins (an elastic job's restarts)."""
    out: list[list[dict]] = []
    with open(path) as f:
        for line in f:
            entry = json.loads(line)
            if not out or entry["step"] == entry["start"]:
                out.append([])
            out[-1].append(entry)
    return out


def wait_phase(path: str, world: int, count: int, job: subprocess.Popen | None = None,
               timeout: float = 120) -> list[dict]:
    """Wait until the last phase of ``path`` runs at ``world`` ranks with ``count`` steps done; return it.
    Fails at once if ``job`` (the launcher that must keep running) has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = phases(path) if os.path.exists(path) else []
        if found and found[-1][0]["world"] == world and len(found[-1]) >= count:
            return found[-1]
        if job is not None and job.poll() is not None:
            break
        time.sleep(0.3)
    seen = open(path).read() if os.path.exists(path) else "(no losses yet)"
    ended = f" (the launcher ended with exit code {job.returncode})" if job is not None and job.poll() is not None else ""
    raise AssertionError(f"no phase at world {world} with {count} steps within {timeout} s{ended}: {seen}")


def stop(procs: list, timeout: float = 30) -> None:
    """End the launchers of a test: SIGTERM to each still running, SIGKILL after ``timeout`` (pipes drained)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("steps", type=int)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--fail_rank", type=int, default=-1)
    p.add_argument("--elastic", action="store_true")
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--hang_rank", type=int, default=-1)
    p.add_argument("--hang_step", type=int, default=1)
    p.add_argument("--local_rank", type=int, default=-1)  # zerospeed launch passes it (as DeepSpeed's)
    a = p.parse_args()
    train(a.out_dir, a.steps, a.ckpt, a.sleep, a.fail_rank, config=config(a.elastic, a.timeout),
          hang_rank=a.hang_rank, hang_step=a.hang_step)
