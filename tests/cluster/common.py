"""Helpers shared by the cluster tests: launch on node0, read what the ranks wrote, the 4-rank reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from zerospeed.testing import run_distributed
from zerospeed.testing.cluster import Cluster, free_port

TRAIN = Path(__file__).parent / "cl_train.py"


def launch_argv(hostfile: str, launcher: str, out: Path, steps: int, *flags: str, script_args: tuple[str, ...] = (),
                port: int | None = None) -> list[str]:
    return [sys.executable, "-m", "zerospeed.launcher.cli", "launch", "--hostfile", hostfile, "--launcher", launcher,
            "--master_port", str(port or free_port()), *flags, str(TRAIN), str(out), str(steps), *script_args]


def launch(cluster: Cluster, argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run the launcher on node0, as a user logged in there would."""
    return cluster.run(0, argv, cwd=str(cwd), env=env, timeout=timeout)


def losses(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]


def rank_info(out: Path, world: int = 4) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _reference(out: str, steps: int) -> list[float]:
    from tests.cluster.cl_train import train  # noqa: PLC0415 - the same loop, forked ranks on one host

    return train(out, steps)


def reference_losses(tmp: Path, steps: int) -> list[float]:
    """The 4-rank single-host run (forked Gloo ranks over loopback)."""
    return run_distributed(_reference, 4, str(tmp), steps, timeout=120)[0]
