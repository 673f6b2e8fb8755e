"""Start one node launcher per host (``--launcher ssh|pdsh|slurm|openmpi``) and wait for them all.

With ``ssh`` there is one client process per host: the first to end with a non-zero code is named (host and
node rank) and the others are stopped (SIGTERM, then SIGKILL after the grace period; ``ssh -tt`` hangs up
the remote launcher, which stops its ranks); under ``--elastic_training`` it has left the job, which goes on
on the other hosts (their torchrun regroups without it). ``pdsh``, ``srun`` and ``mpirun`` are one process each; their
node launchers name the failing node themselves (``nodewatch.py``). A signal to this launcher is passed
on to every child.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from types import FrameType

from zerospeed.launcher import multinode, multinode_flags
from zerospeed.launcher.command import UsageError
from zerospeed.launcher.hostfile import Resources
from zerospeed.launcher.supervise import FORWARDED_SIGNALS, _die_with_parent

_BACKEND_PROGRAM = {"ssh": "ssh", "pdsh": "pdsh", "slurm": "srun", "openmpi": "mpirun"}


def node_args(args: argparse.Namespace, resources: Resources) -> multinode.NodeArgs:
    elastic = multinode_flags.elastic_range(args, len(resources))
    restarts = args.max_restarts
    if restarts is None:
        restarts = multinode_flags.DEFAULT_ELASTIC_RESTARTS if elastic is not None else 0
    return multinode.NodeArgs(
        target=os.path.abspath(args.target) if not args.module else args.target,
        target_args=list(args.target_args), resources=resources,
        master_addr=args.master_addr or next(iter(resources)), master_port=args.master_port or 29500,
        module=args.module, pass_local_rank=args.pass_local_rank, max_restarts=restarts, elastic=elastic,
        rdzv_conf=args.rdzv_conf if elastic is not None else "",
        python=sys.executable, join_timeout=args.node_join_timeout,
        bind_cores=(args.bind_core_list or "") if getattr(args, "bind_cores_to_rank", False) else None,
    )


def backend_env(launcher: str, environ: "os._Environ[str] | dict[str, str]") -> dict[str, str]:
    """The backend program's environment: pdsh connects with ssh (its Debian default is rsh), as DeepSpeed's
    runner sets; a ``PDSH_RCMD_TYPE`` the user chose is kept."""
    env = dict(environ)
    if launcher == "pdsh":
        env.setdefault("PDSH_RCMD_TYPE", "ssh")
    return env


def commands(args: argparse.Namespace, resources: Resources, environ: dict[str, str]) -> list[tuple[str, list[str]]]:
    """``(label, argv)`` of the processes to start for ``args.launcher``."""
    nargs = node_args(args, resources)
    exports = multinode_flags.exports(args, environ)
    cwd = os.getcwd()
    if args.launcher == "ssh":
        return multinode.ssh_commands(nargs, exports, cwd, args.ssh_port, args.launcher_args)
    if args.launcher == "pdsh":
        return [("pdsh", multinode.pdsh_command(nargs, exports, cwd, args.launcher_args))]
    if args.launcher == "slurm":
        filtered = bool(args.include or args.exclude)
        try:
            return [("srun", multinode.slurm_command(nargs, exports, args.launcher_args, filtered, args.slurm_comment))]
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.include or args.exclude or args.num_nodes > 0 or args.nproc_per_node is not None:
        raise UsageError("openmpi backend does not support worker include/exclusion or limiting num nodes/gpus")
    return [("mpirun", multinode.openmpi_command(nargs, exports, os.path.abspath(args.hostfile), args.launcher_args))]


def run(args: argparse.Namespace, resources: Resources) -> int:
    program = _BACKEND_PROGRAM[args.launcher]
    if shutil.which(program) is None:
        raise UsageError(f"launcher '{args.launcher}' not installed ({program} not found on PATH); "
                         "choose another with --launcher ssh|pdsh|slurm|openmpi")
    if not args.module and not os.path.isfile(args.target):
        raise UsageError(f"training script '{args.target}' not found (looked for {os.path.abspath(args.target)})")
    todo = commands(args, resources, dict(os.environ))
    env = backend_env(args.launcher, os.environ)
    procs = [(label, subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_die_with_parent()))
             for label, argv in todo]
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        for _, proc in procs:
            try:
                proc.send_signal(signal.SIGKILL if len(received) > 1 else signum)
            except OSError:
                pass

    previous = {int(s): signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    try:
        return _wait_all(procs, received, grace_s=args.shutdown_timeout + 10.0, elastic=args.elastic_training)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def _wait_all(procs: list[tuple[str, subprocess.Popen[bytes]]], received: list[int], grace_s: float,
              elastic: bool = False) -> int:
    """Wait for every child; on the first failure name it and stop the rest (SIGKILL after ``grace_s``).

    ``elastic`` (``--elastic_training``): a host that fails has left the job, which goes on without it
    (torchrun's rendezvous regroups the rest); each is named, and the job fails only when every host did."""
    first: tuple[str, int, int] | None = None
    deadline: float | None = None
    left: set[int] = set()
    while any(p.poll() is None for _, p in procs):
        for node, (label, proc) in enumerate(procs):
            code = proc.poll()
            if code in (None, 0) or received or node in left:
                continue
            if elastic:
                left.add(node)
                print(f"zerospeed launch: host {label} (node {node}) left the elastic job (exit code {code}); "
                      f"{sum(p.poll() is None for _, p in procs)} host(s) go on", file=sys.stderr, flush=True)
            elif first is None:
                first = (label, node, code)
                where = f"host {label} (node {node})" if len(procs) > 1 else label
                print(f"zerospeed launch: {where} failed with exit code {code}; stopping the other nodes",
                      file=sys.stderr, flush=True)
                for _, other in procs:
                    if other.poll() is None:
                        other.send_signal(signal.SIGTERM)
        if (first or received) and deadline is None:
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            for _, proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.1)
    if received:
        return 128 + received[0]
    if first is not None:
        return first[2]
    codes = [p.returncode for _, p in procs]
    if elastic and 0 in codes:
        return 0  # the job finished on the hosts that stayed
    return max(codes, default=0)
