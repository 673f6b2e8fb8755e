"""No crash at exit: small stage-3 runs, launched as real processes, end with code 0 and no abort.

The cause of the aborts (``terminate called without an active exception`` at interpreter exit) was the
process group never being destroyed: Gloo's worker threads outlived the interpreter. ``init_distributed``
now destroys the group it created at exit; the script reports whether the group was still alive then.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "zero3_exit.py"
RUNS = 3


@pytest.mark.slow
def test_stage3_runs_exit_cleanly() -> None:
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    for _ in range(RUNS):
        cmd = [sys.executable, "-m", "zerospeed.launcher.cli", "launch", "--nproc-per-node", "2", str(SCRIPT)]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-3000:]
        assert "terminate called" not in output and "Abort" not in output and "SIGABRT" not in output, output[-3000:]
        assert output.count("process group alive at exit: False") == 2, output[-3000:]
