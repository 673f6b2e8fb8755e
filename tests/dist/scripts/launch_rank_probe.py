"""Launched by tests/dist/test_launcher.py on each rank; stdlib only (no torch: starts fast).

usage: launch_rank_probe.py OUT_DIR MODE [--local_rank=N]
Each rank writes OUT_DIR/rank_<RANK>.json (its env and argv, pid) at start. Then, by MODE:
  ok     exit 0
  raise  rank 1 raises ValueError; the other ranks sleep (to be stopped by the launcher)
  exit3  rank 1 calls os._exit(3); the other ranks sleep
  sleep  every rank sleeps (to be stopped by a signal to the launcher)
  echo   rank 1 calls os._exit(3); rank 0 raises as soon as rank 1 is dead (like a collective's "connection
         closed by peer"); the other ranks exit 143 from a SIGTERM handler when torchrun stops them
"""

import json
import os
import signal
import sys
import time


def fail_on_purpose(rank: int) -> None:
    raise ValueError(f"rank {rank} fails on purpose")


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def echo_of_rank_1(out_dir: str) -> None:
    path = os.path.join(out_dir, "rank_1.json")
    while not os.path.exists(path):
        time.sleep(0.001)
    with open(path) as f:
        pid = json.load(f)["pid"]
    while not _dead(pid):
        time.sleep(0.001)
    raise RuntimeError("connection closed by peer (rank 1 is gone)")


def main() -> None:
    out_dir, mode = [a for a in sys.argv[1:] if not a.startswith("--local_rank=")]
    rank = int(os.environ["RANK"])
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    info = {"pid": os.getpid(), "argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}
    tmp = os.path.join(out_dir, f".rank_{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, os.path.join(out_dir, f"rank_{rank}.json"))
    if mode == "ok":
        return
    if rank == 1 and mode == "raise":
        time.sleep(0.3)
        fail_on_purpose(rank)
    if mode == "echo":
        if rank == 0:
            echo_of_rank_1(out_dir)
        elif rank == 1:
            time.sleep(0.5)
            os._exit(3)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if rank == 1 and mode == "exit3":
        time.sleep(0.3)
        os._exit(3)
    time.sleep(120)


if __name__ == "__main__":
    main()
