"""``zerospeed launch``'s multi-node flags (DeepSpeed's spellings) and where this invocation stands.

One invocation is either

- a *fan-out*: a hostfile (``--hostfile``, default ``/job/hostfile`` as DeepSpeed) leaves more than one
  host after ``--include/--exclude/--num_nodes/--num_gpus`` (or ``--force_multi``): start one node
  launcher per host through ``--launcher`` (``multinode.py``) and supervise them (``fanout.py``);
- or a *node*: start this node's ranks through torchrun. Its node rank, node count and master come from
  ``--world_info`` (set by a fan-out), from ``SLURM_*`` under ``srun`` with ``--launcher slurm``, from the
  hostfile with ``--no_ssh --node_rank I``, or from ``--nnodes/--node_rank/--master_addr`` by hand.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from zerospeed.launcher import hostfile, multinode
from zerospeed.launcher.command import UsageError

DEFAULT_HOSTFILE = "/job/hostfile"
DEFAULT_ELASTIC_RESTARTS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-H", "--hostfile", default=DEFAULT_HOSTFILE, metavar="FILE",
                        help=f"lines 'HOST slots=N' (default {DEFAULT_HOSTFILE}; absent: this node only)")
    parser.add_argument("-i", "--include", default="", metavar="SPEC",
                        help="use only these hosts/slots: NAME[:SLOT[,SLOT...]][@NAME...], e.g. 'a:0,1@b'")
    parser.add_argument("-e", "--exclude", default="", metavar="SPEC", help="leave out these hosts/slots")
    parser.add_argument("--launcher", default="pdsh", type=str.lower, choices=multinode.LAUNCHERS,
                        help="how a hostfile's nodes are started (default pdsh, as DeepSpeed)")
    parser.add_argument("--launcher_args", "--launcher-args", default="", metavar="ARGS",
                        help="extra arguments for ssh / pdsh / srun / mpirun")
    parser.add_argument("--ssh_port", "--ssh-port", type=int, default=None, metavar="PORT")
    parser.add_argument("--no_ssh", "--no-ssh", action="store_true",
                        help="start only this node (--node_rank I) of the hostfile's job")
    parser.add_argument("--no_ssh_check", "--no-ssh-check", action="store_true",
                        help="accepted for DeepSpeed compatibility (no ssh check is made)")
    parser.add_argument("--force_multi", "--force-multi", action="store_true",
                        help="use --launcher even when one host is left")
    parser.add_argument("--export", action="append", default=[], metavar="KEY=VAL",
                        help="set this variable on every node (repeatable); also read: .deepspeed_env in ~ and .")
    parser.add_argument("--elastic_training", "--elastic-training", action="store_true",
                        help="torchrun's c10d rendezvous: nodes may leave and join; restart from a checkpoint")
    parser.add_argument("--min_elastic_nodes", "--min-elastic-nodes", type=int, default=-1, metavar="N")
    parser.add_argument("--max_elastic_nodes", "--max-elastic-nodes", type=int, default=-1, metavar="N")
    parser.add_argument("--rdzv_conf", "--rdzv-conf", default="", metavar="K=V,...",
                        help="torchrun's --rdzv-conf with --elastic_training (e.g. last_call_timeout=5)")
    parser.add_argument("--node_join_timeout", "--node-join-timeout", type=float, default=600.0, metavar="S",
                        help="seconds node 0 waits for every other node's launcher (default 600)")
    parser.add_argument("--slurm_comment", "--slurm-comment", default="", help=argparse.SUPPRESS)
    parser.add_argument("--world_info", "--world-info", default=None, help=argparse.SUPPRESS)


@dataclass(frozen=True)
class NodeSetup:
    """Where this node stands in the job."""

    nnodes: int
    node_rank: int
    master_addr: str | None
    slots: list[int] | None = None  # hostfile device slots of this node (None: not from a hostfile)
    host: str = ""


def _int_node_rank(value: str, environ: Mapping[str, str]) -> int:
    """``--node_rank``: a number, or ``env:VAR`` (a fan-out's srun / mpirun task reads its own rank)."""
    text = str(value)
    if text.startswith("env:"):
        name = text[4:]
        if name not in environ:
            raise UsageError(f"--node_rank {text}: {name} is not set (not started by srun / mpirun?)")
        text = environ[name]
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"--node-rank takes an integer, got {value!r}") from None


def in_slurm_step(environ: Mapping[str, str]) -> bool:
    return "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ


def _resources(args: argparse.Namespace, pool: Mapping[str, int]) -> hostfile.Resources:
    num_gpus = args.nproc_per_node if args.nproc_per_node is not None else -1
    num_nodes = args.num_nodes if args.num_nodes is not None else -1
    try:
        return hostfile.active_resources(pool, args.include, args.exclude, num_nodes, num_gpus)
    except hostfile.HostfileError as e:
        raise UsageError(str(e)) from None


def read_pool(args: argparse.Namespace) -> dict[str, int] | None:
    try:
        return hostfile.read_hostfile(args.hostfile)
    except hostfile.HostfileError as e:
        raise UsageError(str(e)) from None


def fan_out_resources(args: argparse.Namespace, environ: Mapping[str, str]) -> hostfile.Resources | None:
    """The hosts to fan out to, or ``None`` when this invocation runs one node itself."""
    if args.world_info is not None or args.no_ssh or (args.launcher == "slurm" and in_slurm_step(environ)):
        return None
    pool = read_pool(args)
    if pool is None:
        return None
    resources = _resources(args, pool)
    return resources if len(resources) > 1 or args.force_multi else None


def node_setup(args: argparse.Namespace, environ: Mapping[str, str], local_devices: int) -> NodeSetup:
    """This node's place in the job (see the module docstring for the sources)."""
    if args.world_info is not None:
        resources = multinode.decode_world_info(args.world_info)
        rank = _int_node_rank(args.node_rank, environ)
        if not 0 <= rank < len(resources):
            raise UsageError(f"--node_rank {rank} is outside the {len(resources)} hosts of --world_info")
        host = list(resources)[rank]
        return NodeSetup(len(resources), rank, args.master_addr, resources[host], host)
    if args.launcher == "slurm" and in_slurm_step(environ):
        try:
            nnodes, rank, master = multinode.slurm_node(environ)
        except ValueError as e:
            raise UsageError(str(e)) from None
        return NodeSetup(nnodes, rank, args.master_addr or master, None, socket.gethostname())
    pool = read_pool(args)
    if args.no_ssh and pool is not None:
        resources = _resources(args, pool)
        rank = _int_node_rank(args.node_rank, environ)
        if not 0 <= rank < len(resources):
            raise UsageError(f"--no_ssh: --node_rank must be in 0..{len(resources) - 1} (hosts in "
                             f"{args.hostfile}), got {rank}")
        host = list(resources)[rank]
        return NodeSetup(len(resources), rank, args.master_addr or list(resources)[0], resources[host], host)
    if pool is not None or args.include or args.exclude:  # one host left: run here with its slots
        resources = _resources(args, pool if pool is not None else {"localhost": max(local_devices, 1)})
        host = list(resources)[0]
        return NodeSetup(1, 0, args.master_addr, resources[host], host)
    nnodes = args.nnodes if args.nnodes is not None else max(args.num_nodes, 1)
    return NodeSetup(nnodes, _int_node_rank(args.node_rank, environ), args.master_addr)


def elastic_range(args: argparse.Namespace, nnodes: int) -> tuple[int, int] | None:
    """``(min, max)`` nodes under ``--elastic_training`` (defaults 1 and the node count); checked."""
    if not args.elastic_training:
        if args.min_elastic_nodes > 0 or args.max_elastic_nodes > 0:
            raise UsageError("--min_elastic_nodes / --max_elastic_nodes need --elastic_training")
        return None
    low = args.min_elastic_nodes if args.min_elastic_nodes > 0 else 1
    high = args.max_elastic_nodes if args.max_elastic_nodes > 0 else max(nnodes, low)
    if low > high:
        raise UsageError(f"--min_elastic_nodes ({low}) must not exceed --max_elastic_nodes ({high})")
    return low, high


def exports(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    try:
        return multinode.collect_exports(environ, os.getcwd(), os.path.expanduser("~"), args.export)
    except ValueError as e:
        raise UsageError(str(e)) from None
