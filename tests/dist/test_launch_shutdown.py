"""``zerospeed launch --shutdown-timeout`` holds when a rank hangs (issue 31, item 10).

World 2, rank 1 stops itself (SIGSTOP) before step 1: rank 0 times out in the next collective
(``comms_timeout_s`` 5). torchrun alone would wait a fixed 30 s for the stopped rank to obey SIGTERM; the
job must end within timeout + shutdown-timeout, and both the summary and rank 0's ``CollectiveError``
name rank 1, the rank that never joined, rather than rank 0 that timed out waiting for it. One launch
(fresh interpreters: ~15-25 s on this loaded machine).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

TRAIN = Path(__file__).resolve().parent / "scripts" / "mn_train.py"
TIMEOUT_S, SHUTDOWN_S = 5, 3
pytestmark = pytest.mark.slow


def _agent_time(text: str, marker: str) -> float:
    """Seconds of the day of the torch elastic agent's first log line containing ``marker`` ("W1203 14:22:52.363")."""
    line = next(line for line in text.splitlines() if marker in line)
    match = re.search(r"[IWE]\d{4} (\d+):(\d+):(\d+\.\d+)", line)
    assert match, line
    h, m, sec = match.groups()
    return int(h) * 3600 + int(m) * 60 + float(sec)


def test_hung_rank_is_named_and_shutdown_timeout_holds(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out, log = tmp_path / "out", tmp_path / "launch.log"
    cmd = [sys.executable, "-m", "zerospeed.launcher.cli", "launch", "--nproc-per-node", "2", "--shutdown-timeout",
           str(SHUTDOWN_S), str(TRAIN), str(out), "5", "--timeout", str(TIMEOUT_S), "--hang_rank", "1",
           "--hang_step", "1"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (out / "losses.jsonl").exists():  # step 0 done: rank 1 stops itself now
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        start = time.monotonic()
        proc.wait(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert proc.returncode != 0
    # Bounded: rank 0 fails at the collective timeout, then exits (2.5 s of interpreter teardown measured on a slow
    # 2-core machine), then the agent's SIGTERM and the shutdown timeout; a hang would run into the 60 s wait.
    assert elapsed < TIMEOUT_S + SHUTDOWN_S + 10, f"the job ended {elapsed:.1f} s after the hang:\n{text[-3000:]}"
    # The shutdown timeout itself holds, to the agent's own clock: from its SIGTERM to the stopped rank's kill.
    sigterm, ended = (_agent_time(text, marker) for marker in ("closing signal SIGTERM", "failed (exitcode"))
    assert 0 <= ended - sigterm < SHUTDOWN_S + 2, (sigterm, ended, text[-3000:])
    summary = next(line for line in text.splitlines() if line.startswith("zerospeed launch: rank"))
    assert summary.startswith("zerospeed launch: rank 1 failed") and "never joined" in summary, summary
    assert "rank 1 (the only peer) did not join" in text, text[-3000:]
    pid = int(__import__("json").loads((out / "rank1.json").read_text())["pid"])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
