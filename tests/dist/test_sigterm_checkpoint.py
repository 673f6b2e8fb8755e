"""SIGTERM to `zerospeed launch` while ranks checkpoint every step: no half-written checkpoint is `latest`."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerospeed.runtime.checkpoint import verify_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sigterm_leaves_a_verified_latest(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "zerospeed.launcher.cli", "launch", "--nproc-per-node", "2",
           str(ROOT / "tests" / "dist" / "scripts" / "ckpt_loop.py"), str(ckpt)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    saved = 0
    deadline = time.monotonic() + 90
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("saved "):
            saved += 1
            if saved == 3:
                break
        assert time.monotonic() < deadline, "the trainer did not save in time"
    time.sleep(0.05)  # land the signal somewhere inside the next save
    os.kill(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    path = verify_checkpoint(str(ckpt))  # `latest` names a complete checkpoint whose files all verify
    assert Path(path).name.startswith("step")
    assert int(Path(path).name[4:]) >= 3
    leftovers = [p.name for p in ckpt.iterdir() if p.name.startswith(".tmp-")]
    latest = (ckpt / "latest").read_text().strip()
    assert latest not in leftovers
