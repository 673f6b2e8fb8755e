"""The demo script (what `make demo` runs) works end to end through `zerospeed launch`, on the tiny preset."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_and_reports(tmp_path) -> None:
    cmd = [sys.executable, "-m", "zerospeed.launcher.cli", "launch", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_gpt.py"), "--config", str(ROOT / "examples" / "configs" / "demo_zero2.json"),
           "--preset", "tiny", "--steps", "4", "--out", str(tmp_path), "--sample-bytes", "40"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("summary "))[8:])
    assert summary["tokens_per_s"] > 0 and summary["last_loss"] < 6
    assert "MFU" in out.stdout and "memory rank 1" in out.stdout
    sample = out.stdout.split("sample (temperature 0.8, prompt 'The '):\n", 1)[1].split("\n\n", 1)[0]
    assert sample.startswith("The ") and len(sample.encode("utf-8", errors="replace")) >= 40
    png = (tmp_path / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 500  # the pixels are checked in test_plot_png
    assert (tmp_path / "checkpoint" / "latest").exists()
    assert any((tmp_path / "tensorboard" / "demo").glob("events.out.tfevents.*"))
    assert f"loss curve: {tmp_path / 'loss.png'}" in out.stdout
