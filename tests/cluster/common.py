"""Helpers shared by the cluster tests: launch on node0, read what the ranks wrote, single-host references."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from zerospeed.testing import run_distributed
from zerospeed.testing.cluster import Cluster, free_port

SCRIPTS = Path(__file__).resolve().parents[1] / "dist" / "scripts"
TRAIN = SCRIPTS / "mn_train.py"  # the launcher tests' one training loop
sys.path.insert(0, str(SCRIPTS))
import mn_train  # noqa: E402 - its loop for the forked references, its losses.jsonl readers

sys.path.remove(str(SCRIPTS))


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


def _reference(out: str, steps: int, kwargs: dict) -> list[float]:
    return mn_train.train(out, steps, **kwargs)


def reference_losses(tmp: Path, steps: int, world: int = 4, **kwargs: object) -> list[float]:
    """A single-host run of the same loop (forked Gloo ranks over loopback); ``kwargs`` go to ``train``."""
    return run_distributed(_reference, world, str(tmp), steps, kwargs, timeout=120)[0]
