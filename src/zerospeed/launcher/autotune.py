"""``zerospeed autotune [--nproc-per-node N] [--run] SCRIPT ARGS...``: DeepSpeed's autotuner. Short profiled
runs of SCRIPT over ZeRO stages and micro-batch sizes (and, with ``"autotuning": {"fast": false}``, each stage's
tuning space), pruned by a memory estimate; writes ``ds_config_optimal.json``, ``cmd_optimal.txt`` and
``summary.txt`` to ``autotuning.results_dir``. ``--run`` then launches SCRIPT with the optimal config
(DeepSpeed's ``--autotuning run``). SCRIPT must take its config as ``--deepspeed_config PATH`` (or ``--config``,
or the flag named by ``autotuning.arg_mappings.deepspeed_config``)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from zerospeed.launcher.command import Command, UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc-per-node", "--nproc_per_node", "--num_gpus", type=int, default=1, dest="nproc")
    parser.add_argument("--run", action="store_true", help="after tuning, launch the script with the optimal config")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one experiment may take")
    parser.add_argument("script", metavar="SCRIPT")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")


def run(args: argparse.Namespace) -> int:
    from zerospeed.autotuning import Autotuner

    try:
        tuner = Autotuner(args.script, list(args.script_args), nproc=args.nproc, timeout_s=args.timeout)
        best = tuner.tune()
    except (ValueError, OSError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    print(f"zerospeed autotune: optimal {best.name}; files in {tuner.at.results_dir}")
    if not args.run:
        return 0
    import os

    opt = os.path.abspath(os.path.join(tuner.at.results_dir, "ds_config_optimal.json"))
    cmd = [sys.executable, "-m", "zerospeed.launcher.cli", "launch", "--nproc-per-node", str(args.nproc),
           args.script, *tuner._args_with(opt)]
    return subprocess.call(cmd)


COMMAND = Command(name="autotune", help="find a fast config by short profiled runs (DeepSpeed's autotuner)",
                  description=__doc__, add_arguments=add_arguments, run=run)
