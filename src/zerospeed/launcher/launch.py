"""``zerospeed launch``: start N ranks of a training script through PyTorch's elastic agent (torchrun).

We write no process launcher: the ranks are started by ``python -m torch.distributed.run`` (static
rendezvous, 0.1 s monitor interval, restarts only if asked) running as our child process, so that this
package never imports ``torch.distributed``. Each rank runs ``rank_entry.py`` first, which records its pid and
reports how it failed; ``supervise.py`` forwards signals and leaves no process behind;
``failures.py`` turns what happened into one line naming the failing rank(s).

The flags accept DeepSpeed's spellings (``--num_gpus``, ``--master_port`` ...) as well as torchrun's.
Several nodes: a hostfile fans out to one node launcher per host (``multinode_flags.py``, ``fanout.py``);
each node launcher keeps a line to node 0's (``nodewatch.py``) so a lost or failing node is named.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerospeed.launcher import failures, multinode, multinode_flags, nodewatch, rank_entry, supervise
from zerospeed.launcher.command import Command, UsageError

DEFAULT_MASTER_PORT = 29500
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
RANKS_PER_NODE_ENV = "ZEROSPEED_RANKS_PER_NODE"  # read by comm/hierarchy.py (torchrun sets LOCAL_WORLD_SIZE too)


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
    pass_local_rank: bool = True
    bind_cores: str | None = None  # --bind_cores_to_rank: the --bind_core_list, "" for every core; None: off
    max_restarts: int = 0
    shutdown_timeout: int = 10
    elastic: tuple[int, int] | None = None  # (min_nodes, max_nodes): c10d rendezvous, --nnodes=MIN:MAX
    rdzv_id: str = "zerospeed"
    rdzv_conf: str = ""
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES for this node's ranks (hostfile slots)
    host: str = ""  # this node's name in the hostfile (for messages)
    join_timeout: float = 600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``zerospeed launch`` (torchrun's and DeepSpeed's spellings)."""
    parser.add_argument("--nproc-per-node", "--nproc_per_node", "--num-gpus", "--num_gpus", type=int,
                        dest="nproc_per_node", default=None, metavar="N",
                        help="ranks on this node (default: the visible CUDA devices, else 1)")
    parser.add_argument("--nnodes", type=int, dest="nnodes", default=None,
                        metavar="N", help="number of nodes when each node is started by hand (default 1)")
    parser.add_argument("--num-nodes", "--num_nodes", type=int, dest="num_nodes", default=-1, metavar="N",
                        help="with a hostfile: use its first N hosts (DeepSpeed); without: same as --nnodes")
    parser.add_argument("--node-rank", "--node_rank", dest="node_rank", default="0", metavar="I",
                        help="this node's index, 0..nnodes-1 (default 0)")
    parser.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None, metavar="HOST",
                        help="address of node 0 (default 127.0.0.1; required with --nnodes > 1)")
    parser.add_argument("--master-port", "--master_port", type=int, dest="master_port", default=None,
                        metavar="PORT", help=f"port on node 0 (default: a free port on one node, "
                        f"{DEFAULT_MASTER_PORT} on several)")
    parser.add_argument("--pass-local-rank", "--pass_local_rank", action="store_true", dest="pass_local_rank",
                        default=True, help="put --local_rank=<n> before the script's arguments (the default, as "
                        "DeepSpeed's launcher does)")
    parser.add_argument("--no-local-rank", "--no_local_rank", action="store_false", dest="pass_local_rank",
                        help="do not pass --local_rank (DeepSpeed's flag; the rank reads LOCAL_RANK instead)")
    parser.add_argument("--bind_cores_to_rank", "--bind-cores-to-rank", action="store_true",
                        help="pin each rank to its equal share of the cores and set OMP_NUM_THREADS to it")
    parser.add_argument("--bind_core_list", "--bind-core-list", default=None, metavar="LIST",
                        help="the cores to share with --bind_cores_to_rank, e.g. 0-3,8-11 (default: all)")
    parser.add_argument("-m", "--module", action="store_true",
                        help="SCRIPT is a module name: run it like 'python -m SCRIPT'")
    parser.add_argument("--max-restarts", "--max_restarts", type=int, dest="max_restarts", default=None,
                        metavar="N", help="restart the whole group up to N times after a failure "
                        f"(default 0; {multinode_flags.DEFAULT_ELASTIC_RESTARTS} with --elastic_training)")
    parser.add_argument("--shutdown-timeout", "--shutdown_timeout", type=int, dest="shutdown_timeout",
                        default=10, metavar="S", help="seconds a rank gets to exit after SIGTERM before "
                        "SIGKILL (default 10)")
    multinode_flags.add_arguments(parser)
    parser.add_argument("--autotuning", choices=["tune", "run"], default=None,
                        help="DeepSpeed's autotuner (zerospeed autotune): 'tune' finds a fast config, 'run' then "
                        "launches the script with it")
    _add_unsupported_flags(parser)
    parser.add_argument("target", metavar="SCRIPT", help="training script (or module, with --module)")
    parser.add_argument("target_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments for the script")


_UNSUPPORTED_DEEPSPEED_FLAGS: dict[tuple[str, ...], str] = {
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


def plan_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> LaunchPlan:
    """Check the arguments and fill the defaults; raise ``UsageError`` naming the flag and the fix."""
    env = dict(os.environ if environ is None else environ)
    node = multinode_flags.node_setup(args, env, visible_cuda_devices())
    if node.slots is not None:
        nproc = len(node.slots)
    else:
        nproc = args.nproc_per_node if args.nproc_per_node is not None else max(visible_cuda_devices(), 1)
    if nproc < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, got {nproc}")
    nnodes, node_rank = node.nnodes, node.node_rank
    if nnodes < 1:
        raise UsageError(f"--nnodes must be at least 1, got {nnodes}")
    elastic = multinode_flags.elastic_range(args, nnodes)
    if elastic is None and not 0 <= node_rank < nnodes:
        raise UsageError(f"--node-rank must be in 0..{nnodes - 1} (--nnodes {nnodes}), got {node_rank}")
    if (nnodes > 1 or elastic is not None and elastic[1] > 1) and not node.master_addr:
        raise UsageError(
            f"--nnodes {nnodes} needs --master-addr, the address of node 0 reachable from every node"
        )
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise UsageError(f"--master-port must be in 1..65535, got {args.master_port}")
    max_restarts = args.max_restarts
    if max_restarts is None:
        max_restarts = multinode_flags.DEFAULT_ELASTIC_RESTARTS if elastic is not None else 0
    if max_restarts < 0 or args.shutdown_timeout < 0:
        raise UsageError("--max-restarts and --shutdown-timeout must be non-negative")
    if not args.module and not Path(args.target).is_file():
        where = Path(args.target).resolve()
        raise UsageError(f"training script '{args.target}' not found (looked for {where})")
    if args.master_port is not None:
        port = args.master_port
    else:
        port = free_port() if nnodes == 1 and elastic is None else DEFAULT_MASTER_PORT
    return LaunchPlan(
        target=args.target, target_args=list(args.target_args), module=args.module, nproc_per_node=nproc,
        nnodes=nnodes, node_rank=node_rank, master_addr=node.master_addr or "127.0.0.1",
        master_port=port, pass_local_rank=args.pass_local_rank, max_restarts=max_restarts,
        shutdown_timeout=args.shutdown_timeout, elastic=elastic,
        rdzv_id=env.get("ZEROSPEED_RDZV_ID", f"zerospeed-{port}"), rdzv_conf=args.rdzv_conf,
        visible_devices=",".join(map(str, node.slots)) if node.slots is not None else None,
        host=node.host, join_timeout=args.node_join_timeout, bind_cores=_bind_cores(args),
    )


def _bind_cores(args: argparse.Namespace) -> str | None:
    """``--bind_cores_to_rank`` [``--bind_core_list``]: the list each node's ranks share (checked here)."""
    bind, spec = getattr(args, "bind_cores_to_rank", False), getattr(args, "bind_core_list", None)
    if spec is not None and not bind:
        raise UsageError("--bind_core_list needs --bind_cores_to_rank (as in DeepSpeed)")
    if not bind:
        return None
    try:
        rank_entry.parse_core_list(spec or "")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return spec or ""


def torchrun_argv(plan: LaunchPlan, python: str = sys.executable) -> list[str]:
    """The torchrun command line: every rank runs ``rank_entry.py TARGET ARGS`` (by path, see there)."""
    if plan.elastic is None:
        rendezvous = [f"--nnodes={plan.nnodes}", f"--node-rank={plan.node_rank}",
                      f"--master-addr={plan.master_addr}", f"--master-port={plan.master_port}"]
    else:  # c10d rendezvous: torchrun numbers the nodes; --nnodes=MIN:MAX
        low, high = plan.elastic
        rendezvous = [f"--nnodes={low}:{high}", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint={plan.master_addr}:{plan.master_port}", f"--rdzv-id={plan.rdzv_id}"]
        if plan.rdzv_conf:
            rendezvous.append(f"--rdzv-conf={plan.rdzv_conf}")
    return [
        python, "-m", "torch.distributed.run",
        *rendezvous,
        f"--nproc-per-node={plan.nproc_per_node}",
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
    if plan.bind_cores is not None:
        env[rank_entry.BIND_CORES_ENV] = plan.bind_cores
    env[SHUTDOWN_TIMEOUT_ENV] = str(plan.shutdown_timeout)
    env[RANKS_PER_NODE_ENV] = str(plan.nproc_per_node)
    if plan.visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = plan.visible_devices
    if plan.elastic is not None:
        # torch 2.13's c10d rendezvous shares its TCP store and publishes MASTER_ADDR only in the first round
        # a node is rank 0 of: a node joining later waits for it forever. Not sharing the store avoids it.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return env


class _Stopper:
    """Stops torchrun when a peer node fails (SIGTERM, then SIGKILL of its group after ``grace_s``), also
    when the peer's report comes before torchrun has started."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stopping = threading.Event()

    def started(self, proc: subprocess.Popen[bytes]) -> None:
        self.procs.append(proc)
        if self.stopping.is_set():
            self._stop(proc)

    def on_event(self, node: int, text: str) -> None:
        print(f"zerospeed launch: {text}; stopping this node's ranks", file=sys.stderr, flush=True)
        self.stopping.set()
        for proc in list(self.procs):
            self._stop(proc)

    def _stop(self, proc: subprocess.Popen[bytes]) -> None:
        try:
            proc.send_signal(signal.SIGTERM)
        except OSError:
            return

        def kill_later() -> None:
            try:
                proc.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass

        threading.Thread(target=kill_later, daemon=True).start()


def launch(plan: LaunchPlan, exports: dict[str, str] | None = None) -> int:
    """Start the ranks, wait for them, print a summary if any failed; return the exit code."""
    launch_dir = tempfile.mkdtemp(prefix="zerospeed-launch-")
    stopper = _Stopper(grace_s=plan.shutdown_timeout + 5.0)
    watch = None
    if plan.nnodes > 1 and plan.elastic is None:
        watch = nodewatch.NodeWatch(plan.node_rank, plan.nnodes, plan.master_addr, plan.master_port,
                                    plan.host or socket.gethostname(), stopper.on_event, plan.join_timeout)
    code, message = 1, ""
    try:
        if watch is not None:
            try:
                watch.start()
            except OSError as e:
                raise UsageError(f"node 0 cannot listen on port {plan.master_port + nodewatch.WATCH_PORT_OFFSET} "
                                 f"(--master_port + 1, the node watch): {e}") from None
        env = rank_env(plan, launch_dir)
        env.update(exports or {})
        result = supervise.run_agent(torchrun_argv(plan), env, launch_dir, grace_s=plan.shutdown_timeout + 5.0,
                                     on_start=stopper.started, shutdown_timeout=plan.shutdown_timeout)
        if result.killed_leftovers:
            ranks = ", ".join(map(str, result.killed_leftovers))
            print(f"zerospeed launch: killed rank(s) {ranks}, still running after torchrun exited",
                  file=sys.stderr)
        if result.received_signal is not None:
            name = signal.Signals(result.received_signal).name
            print(f"zerospeed launch: got {name}; the ranks were stopped", file=sys.stderr)
            code, message = 128 + result.received_signal, f"got {name}"
            return code
        if result.exitcode == 0:
            code = 0
            return 0
        if watch is not None and watch.event is None and not watch.silent():
            time.sleep(2.0)  # a peer's report of its own failure (often the cause of ours) is on its way
        if watch is not None:
            watch.blame_silent()  # no report came: a peer not heard from is the likely cause
        agent = failures.parse_torchrun_failures(result.stderr_tail)
        closed = failures.stopped_ranks(result.stderr_tail, launch_dir)
        failing, stopped = failures.merge_failures(failures.read_rank_reports(launch_dir), agent, closed)
        failing, stopped = failures.blame_hung(failing, stopped, [(h.rank, h.state) for h in result.hung],
                                               plan.shutdown_timeout)
        summary = failures.summarize(failing, stopped, result.exitcode)
        if watch is not None and watch.event is not None:
            summary = f"zerospeed launch: {watch.event}\n" + summary.replace("zerospeed launch: ", "  here: ", 1)
        print(summary, file=sys.stderr, flush=True)
        code = failures.exit_code_for(failing, result.exitcode)
        message = summary.splitlines()[0].replace("zerospeed launch: ", "", 1)
        return code
    finally:
        if watch is not None:
            watch.finish(code, message)
        shutil.rmtree(launch_dir, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    if args.autotuning is not None:  # DeepSpeed's `deepspeed --autotuning tune|run train.py ...`
        from zerospeed.launcher import autotune

        return autotune.run(argparse.Namespace(nproc=args.nproc_per_node or 1, run=args.autotuning == "run",
                                               timeout=600.0, script=args.target, script_args=args.target_args))
    resources = multinode_flags.fan_out_resources(args, dict(os.environ))
    if resources is not None:
        from zerospeed.launcher import fanout

        return fanout.run(args, resources)
    try:
        plan = plan_from_args(args)
    except UsageError as e:
        _report_node_failure(args, str(e))
        raise
    return launch(plan, multinode_flags.exports(args, dict(os.environ)) if args.export else None)


def _report_node_failure(args: argparse.Namespace, message: str) -> None:
    """A node of a several-node job whose launch fails at once tells node 0 (best effort, a few seconds)."""
    nnodes = args.nnodes if args.nnodes is not None else max(args.num_nodes, 1)
    if args.world_info is not None:
        nnodes = len(multinode.decode_world_info(args.world_info))
    try:
        node_rank = int(args.node_rank)
    except ValueError:
        return
    if nnodes < 2 or node_rank == 0 or not args.master_addr or args.elastic_training:
        return
    port = args.master_port if args.master_port is not None else DEFAULT_MASTER_PORT
    nodewatch.report_early_failure(args.master_addr, port, node_rank, socket.gethostname(), 2, message)


COMMAND = Command(
    name="launch",
    help="run a training script on N ranks per node (through torchrun)",
    description=(
        "Start --nproc-per-node ranks of SCRIPT on this node through PyTorch's elastic agent, or on every "
        "host of a DeepSpeed hostfile (--hostfile, --launcher). Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, "
        "MASTER_ADDR and MASTER_PORT. If a rank or a node fails, the others are stopped and the failing rank "
        "or node, its exit code and its traceback are named."
    ),
    add_arguments=add_arguments,
    run=run,
)
