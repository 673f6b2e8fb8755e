"""Launched by tests/dist/test_launcher.py on each rank; stdlib only (no torch: starts fast).

usage: launch_rank_probe.py OUT_DIR MODE [--local_rank=N]
Each rank writes OUT_DIR/rank_<RANK>.json (its env and argv, pid) at start. Then, by MODE:
  ok     exit 0
  raise  rank 1 raises ValueError; the other ranks sleep (to be stopped by the launcher)
  exit3  rank 1 calls os._exit(3); the other ranks sleep
  sleep  every rank sleeps (to be stopped by a signal to the launcher)
"""

import json
import os
import sys
import time


def fail_on_purpose(rank: int) -> None:
    raise ValueError(f"rank {rank} fails on purpose")


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
    if rank == 1 and mode == "exit3":
        time.sleep(0.3)
        os._exit(3)
    time.sleep(120)


if __name__ == "__main__":
    main()
