"""``zerospeed launch``: start N ranks of a training script through PyTorch's elastic agent (torchrun).

We write no process launcher: the ranks are started by ``python -m torch.distributed.run`` (static
rendezvous, 0.1 s monitor interval, restarts only if asked) running as our child process, so that this
package never imports ``torch.distributed``. Each rank runs ``rank_entry.py`` first, which records its pid and
reports how it failed; ``supervise.py`` forwards signals and leaves no process behind;
``failures.py`` turns what happened into one line naming the failing rank(s).

The flags accept DeepSpeed's spellings (``--num_gpus``, ``--master_port`` ...) as well as torchrun's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerospeed.launcher import failures, rank_entry, supervise
from zerospeed.launcher.command import Command, UsageError

DEFAULT_MASTER_PORT = 29500
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to start one node's ranks; built and checked by ``plan_from_args``."""

    target: str
    target_args: list[str] = field(default_factory=list)
    module: bool = False
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    pass_local_rank: bool = False
    max_restarts: int = 0
    shutdown_timeout: int = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``zerospeed launch`` (torchrun's and DeepSpeed's spellings)."""
    parser.add_argument("--nproc-per-node", "--nproc_per_node", "--num-gpus", "--num_gpus", type=int,
                        dest="nproc_per_node", default=None, metavar="N",
                        help="ranks on this node (default: the visible CUDA devices, else 1)")
    parser.add_argument("--nnodes", "--num-nodes", "--num_nodes", type=int, dest="nnodes", default=1,
                        metavar="N", help="number of nodes (default 1)")
    parser.add_argument("--node-rank", "--node_rank", type=int, dest="node_rank", default=0, metavar="I",
                        help="this node's index, 0..nnodes-1 (default 0)")
    parser.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None, metavar="HOST",
                        help="address of node 0 (default 127.0.0.1; required with --nnodes > 1)")
    parser.add_argument("--master-port", "--master_port", type=int, dest="master_port", default=None,
                        metavar="PORT", help=f"port on node 0 (default: a free port on one node, "
                        f"{DEFAULT_MASTER_PORT} on several)")
    parser.add_argument("--pass-local-rank", "--pass_local_rank", action="store_true", dest="pass_local_rank",
                        help="append --local_rank=<n> to the script's arguments, as DeepSpeed's launcher does")
    parser.add_argument("--no-local-rank", "--no_local_rank", action="store_false", dest="pass_local_rank",
                        help="do not pass --local_rank (the default; accepted for DeepSpeed compatibility)")
    parser.add_argument("-m", "--module", action="store_true",
                        help="SCRIPT is a module name: run it like 'python -m SCRIPT'")
    parser.add_argument("--max-restarts", "--max_restarts", type=int, dest="max_restarts", default=0,
                        metavar="N", help="restart the whole group up to N times after a failure (default 0)")
    parser.add_argument("--shutdown-timeout", "--shutdown_timeout", type=int, dest="shutdown_timeout",
                        default=10, metavar="S", help="seconds a rank gets to exit after SIGTERM before "
                        "SIGKILL (default 10)")
    _add_unsupported_flags(parser)
    parser.add_argument("target", metavar="SCRIPT", help="training script (or module, with --module)")
    parser.add_argument("target_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments for the script")


_MULTI_NODE_HINT = "run 'zerospeed launch --nnodes N --node-rank I --master-addr HOST' on each node instead"
_UNSUPPORTED_DEEPSPEED_FLAGS: dict[tuple[str, ...], str] = {
    ("-H", "--hostfile"): _MULTI_NODE_HINT,
    ("--launcher", "--launcher_args", "--launcher-args", "--no_ssh", "--no_ssh_check", "--ssh_port",
     "--force_multi"): _MULTI_NODE_HINT,
    ("-i", "--include", "-e", "--exclude"): "choose devices with CUDA_VISIBLE_DEVICES and --nproc-per-node",
    ("--min_elastic_nodes", "--max_elastic_nodes", "--elastic_training"): "elastic node counts are not "
    "supported; use a fixed --nnodes",
    ("--autotuning",): "autotuning is not supported",
    ("--bind_cores_to_rank", "--bind_core_list"): "set OMP_NUM_THREADS / taskset in the script's environment",
    ("--no_python", "--no-python"): "launch a Python script or module (--module)",
    ("--save_pid", "--enable_each_rank_log"): "redirect the output yourself",
}


class _NotSupportedYet(argparse.Action):
    """A DeepSpeed launcher flag we do not have: fail at once, naming the flag and what to do instead."""

    def __init__(self, *args: Any, hint: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hint = hint

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        raise UsageError(f"DeepSpeed's launcher flag {option_string} is not supported yet: {self.hint}")


def _add_unsupported_flags(parser: argparse.ArgumentParser) -> None:
    for flags, hint in _UNSUPPORTED_DEEPSPEED_FLAGS.items():
        parser.add_argument(*flags, action=_NotSupportedYet, nargs="?", hint=hint, help=argparse.SUPPRESS)


def visible_cuda_devices() -> int:
    """Count CUDA devices without importing torch: ``CUDA_VISIBLE_DEVICES``, else the NVIDIA driver's list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for entry in visible.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break  # CUDA ignores everything from the first invalid entry on
            count += 1
        return count
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def free_port() -> int:
    """A TCP port that is free on this machine now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def plan_from_args(args: argparse.Namespace) -> LaunchPlan:
    """Check the arguments and fill the defaults; raise ``UsageError`` naming the flag and the fix."""
    nproc = args.nproc_per_node if args.nproc_per_node is not None else max(visible_cuda_devices(), 1)
    if nproc < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, got {nproc}")
    if args.nnodes < 1:
        raise UsageError(f"--nnodes must be at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise UsageError(
            f"--node-rank must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes}), got {args.node_rank}"
        )
    if args.nnodes > 1 and not args.master_addr:
        raise UsageError(
            f"--nnodes {args.nnodes} needs --master-addr, the address of node 0 reachable from every node"
        )
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise UsageError(f"--master-port must be in 1..65535, got {args.master_port}")
    if args.max_restarts < 0 or args.shutdown_timeout < 0:
        raise UsageError("--max-restarts and --shutdown-timeout must be non-negative")
    if not args.module and not Path(args.target).is_file():
        where = Path(args.target).resolve()
        raise UsageError(f"training script '{args.target}' not found (looked for {where})")
    if args.master_port is not None:
        port = args.master_port
    else:
        port = free_port() if args.nnodes == 1 else DEFAULT_MASTER_PORT
    return LaunchPlan(
        target=args.target, target_args=list(args.target_args), module=args.module, nproc_per_node=nproc,
        nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr or "127.0.0.1",
        master_port=port, pass_local_rank=args.pass_local_rank, max_restarts=args.max_restarts,
        shutdown_timeout=args.shutdown_timeout,
    )


def torchrun_argv(plan: LaunchPlan, python: str = sys.executable) -> list[str]:
    """The torchrun command line: every rank runs ``rank_entry.py TARGET ARGS`` (by path, see there)."""
    return [
        python, "-m", "torch.distributed.run",
        f"--nnodes={plan.nnodes}",
        f"--nproc-per-node={plan.nproc_per_node}",
        f"--node-rank={plan.node_rank}",
        f"--master-addr={plan.master_addr}",
        f"--master-port={plan.master_port}",
        f"--max-restarts={plan.max_restarts}",
        "--monitor-interval=0.1",
        os.path.abspath(rank_entry.__file__),
        plan.target,
        *plan.target_args,
    ]


def rank_env(plan: LaunchPlan, launch_dir: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment torchrun (and, through it, every rank) gets."""
    env = dict(os.environ if base is None else base)
    env[rank_entry.LAUNCH_DIR_ENV] = launch_dir
    env[rank_entry.PASS_LOCAL_RANK_ENV] = "1" if plan.pass_local_rank else "0"
    env[rank_entry.MODULE_ENV] = "1" if plan.module else "0"
    env[SHUTDOWN_TIMEOUT_ENV] = str(plan.shutdown_timeout)
    return env


def launch(plan: LaunchPlan) -> int:
    """Start the ranks, wait for them, print a summary if any failed; return the exit code."""
    launch_dir = tempfile.mkdtemp(prefix="zerospeed-launch-")
    try:
        result = supervise.run_agent(torchrun_argv(plan), rank_env(plan, launch_dir), launch_dir,
                                     grace_s=plan.shutdown_timeout + 5.0)
        if result.killed_leftovers:
            ranks = ", ".join(map(str, result.killed_leftovers))
            print(f"zerospeed launch: killed rank(s) {ranks}, still running after torchrun exited",
                  file=sys.stderr)
        if result.received_signal is not None:
            name = signal.Signals(result.received_signal).name
            print(f"zerospeed launch: got {name}; the ranks were stopped", file=sys.stderr)
            return 128 + result.received_signal
        if result.exitcode == 0:
            return 0
        agent = failures.parse_torchrun_failures(result.stderr_tail)
        closed = failures.stopped_ranks(result.stderr_tail, launch_dir)
        failing, stopped = failures.merge_failures(failures.read_rank_reports(launch_dir), agent, closed)
        print(failures.summarize(failing, stopped, result.exitcode), file=sys.stderr, flush=True)
        return failures.exit_code_for(failing, result.exitcode)
    finally:
        shutil.rmtree(launch_dir, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    return launch(plan_from_args(args))


COMMAND = Command(
    name="launch",
    help="run a training script on N ranks per node (through torchrun)",
    description=(
        "Start --nproc-per-node ranks of SCRIPT on this node through PyTorch's elastic agent. Each rank "
        "gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. If a rank fails, the others are "
        "stopped and the failing rank, its exit code and its traceback are named."
    ),
    add_arguments=add_arguments,
    run=run,
)
