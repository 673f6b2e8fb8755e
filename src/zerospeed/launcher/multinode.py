"""The command lines that start one ``zerospeed launch`` per node, per ``--launcher`` (pure functions).

Unlike DeepSpeed, whose backends start every rank of the job themselves, every backend here starts one
*node launcher* per host: ``python -u -m zerospeed.launcher.cli launch --nnodes N --node_rank I ...``,
which runs torchrun for that host's ranks and names any failure. So ranks get torchrun's environment,
its rendezvous (static, or c10d with ``--elastic_training``) and its failure handling on every backend.

- ``ssh``: one ``ssh [-p PORT] -tt HOST 'cd CWD && export ...; python -u -m ... --node_rank=I'`` per host
  (``-tt``: closing the connection hangs up the remote launcher, which then stops its ranks);
- ``pdsh``: one ``pdsh -S -f 1024 -w HOSTS`` command, node rank ``%n`` (pdsh substitutes the host's index);
- ``slurm``: ``srun -n NODES --ntasks-per-node=1 --export=ALL,...``; each task reads ``SLURM_NODEID``;
- ``openmpi``: ``mpirun -n NODES --map-by ppr:1:node -hostfile HOSTFILE -x K=V ...``; each process reads
  ``OMPI_COMM_WORLD_RANK``.

Which slots each host uses travels as ``--world_info`` (base64 JSON ``{host: [slots]}``, as DeepSpeed's);
the node launcher sets ``CUDA_VISIBLE_DEVICES`` and its rank count from its own entry.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from zerospeed.launcher.hostfile import Resources

LAUNCHERS = ("ssh", "pdsh", "slurm", "openmpi")
PDSH_MAX_FAN_OUT = 1024
# DeepSpeed's EXPORT_ENVS + CUDA's export_envs, and Gloo's (GLOO_SOCKET_IFNAME picks the interface the ranks
# bind: on CPU it matters as NCCL_SOCKET_IFNAME does on GPU).
EXPORT_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL", "GLOO")
ENV_FILE_NAME_VAR = "DS_ENV_FILE"
DEFAULT_ENV_FILE = ".deepspeed_env"
NODE_RANK_ENV = {"slurm": "SLURM_NODEID", "openmpi": "OMPI_COMM_WORLD_RANK"}


@dataclass(frozen=True)
class NodeArgs:
    """What every node launcher is told besides its node rank."""

    target: str
    target_args: Sequence[str] = ()
    resources: Resources = field(default_factory=dict)
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    module: bool = False
    pass_local_rank: bool = True
    bind_cores: str | None = None  # --bind_cores_to_rank's core list ("" for all); None: off
    max_restarts: int = 0
    elastic: tuple[int, int] | None = None  # (min_nodes, max_nodes) with --elastic_training
    rdzv_conf: str = ""  # torchrun's --rdzv-conf with --elastic_training
    python: str = "python"
    join_timeout: float = 600.0


def encode_world_info(resources: Resources) -> str:
    return base64.urlsafe_b64encode(json.dumps(resources).encode("utf-8")).decode("ascii")


def decode_world_info(text: str) -> Resources:
    data = json.loads(base64.urlsafe_b64decode(text.encode("ascii")).decode("utf-8"))
    return {str(h): [int(s) for s in slots] for h, slots in data.items()}


def read_env_files(paths: Sequence[str], name: str) -> dict[str, str]:
    """``KEY=VALUE`` lines of ``<path>/<name>`` for each path in order (later files win), as DeepSpeed reads
    ``~/.deepspeed_env`` then ``./.deepspeed_env``; blank lines and ``#`` comments are skipped."""
    out: dict[str, str] = {}
    for folder in paths:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                text = line.strip()
                if not text or text.startswith("#"):
                    continue
                key, sep, value = text.partition("=")
                if not sep or not key.strip():
                    raise ValueError(f"{path}:{number}: expected KEY=VALUE, got {text!r}")
                out[key.strip()] = value.strip()
    return out


def collect_exports(environ: Mapping[str, str], cwd: str, home: str, extra: Sequence[str] = ()) -> dict[str, str]:
    """The variables sent to every node: ``PYTHONPATH`` with the cwd first, the DeepSpeed-exported prefixes,
    the ``.deepspeed_env`` files (home, then cwd), then ``--export KEY=VAL`` (last wins)."""
    exports = {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES)}
    exports["PYTHONPATH"] = cwd + (":" + environ["PYTHONPATH"] if environ.get("PYTHONPATH") else "")
    exports.update(read_env_files([home, cwd], environ.get(ENV_FILE_NAME_VAR, DEFAULT_ENV_FILE)))
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"--export takes KEY=VALUE with a shell variable name, got {item!r}")
        exports[key] = value
    return exports


def node_launch_argv(args: NodeArgs, node_rank: str) -> list[str]:
    """One node's ``zerospeed launch`` command; ``node_rank`` is a number, ``%n`` (pdsh) or ``env:VAR``."""
    argv = [args.python, "-u", "-m", "zerospeed.launcher.cli", "launch",
            f"--world_info={encode_world_info(args.resources)}", f"--node_rank={node_rank}",
            f"--nnodes={len(args.resources)}", f"--master_addr={args.master_addr}",
            f"--master_port={args.master_port}", f"--max_restarts={args.max_restarts}",
            f"--node_join_timeout={args.join_timeout:g}"]
    if args.elastic is not None:
        argv += ["--elastic_training", f"--min_elastic_nodes={args.elastic[0]}",
                 f"--max_elastic_nodes={args.elastic[1]}"]
        argv += [f"--rdzv_conf={args.rdzv_conf}"] if args.rdzv_conf else []
    if args.module:
        argv.append("--module")
    if not args.pass_local_rank:  # passing it is the default (DeepSpeed's)
        argv.append("--no_local_rank")
    if args.bind_cores is not None:
        argv.append("--bind_cores_to_rank")
        argv += ["--bind_core_list", args.bind_cores] if args.bind_cores else []
    return [*argv, args.target, *args.target_args]


def _shell(exports: Mapping[str, str], cwd: str, argv: Sequence[str]) -> str:
    env = "".join(f"export {k}={shlex.quote(v)}; " for k, v in exports.items())
    return f"cd {shlex.quote(cwd)} && {env}exec {shlex.join(argv)}"


def ssh_commands(args: NodeArgs, exports: Mapping[str, str], cwd: str, ssh_port: int | None = None,
                 launcher_args: str = "") -> list[tuple[str, list[str]]]:
    """``(host, argv)`` per host: an ``ssh`` running that host's node launcher."""
    port = ["-p", str(ssh_port)] if ssh_port is not None else []
    return [(host, ["ssh", *port, "-tt", *shlex.split(launcher_args), host,
                    _shell(exports, cwd, node_launch_argv(args, str(i)))])
            for i, host in enumerate(args.resources)]


def pdsh_command(args: NodeArgs, exports: Mapping[str, str], cwd: str, launcher_args: str = "") -> list[str]:
    """One ``pdsh`` command starting every host's node launcher (pdsh puts the host's index for ``%n``)."""
    hosts = ",".join(args.resources)
    return ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", hosts, *shlex.split(launcher_args),
            _shell(exports, cwd, node_launch_argv(args, "%n"))]


def slurm_command(args: NodeArgs, exports: Mapping[str, str], launcher_args: str = "",
                  nodelist: bool = False, comment: str = "") -> list[str]:
    """``srun`` with one task per node; ``nodelist``: name the hosts (after --include/--exclude)."""
    counts = {len(slots) for slots in args.resources.values()}
    if len(counts) > 1:
        raise ValueError(f"slurm backend needs the same slot count on every host, got "
                         f"{ {h: len(s) for h, s in args.resources.items()} }")
    n = len(args.resources)
    cmd = ["srun", "-n", str(n), "--ntasks-per-node=1", *shlex.split(launcher_args)]
    if comment:
        cmd += ["--comment", comment]
    if nodelist:
        cmd += ["--nodelist", ",".join(args.resources), "--nodes", str(n)]
    env = "--export=ALL" + "".join(f",{k}={v}" for k, v in exports.items())
    return [*cmd, env, *node_launch_argv(args, "env:" + NODE_RANK_ENV["slurm"])]


def openmpi_command(args: NodeArgs, exports: Mapping[str, str], hostfile: str, launcher_args: str = "") -> list[str]:
    """``mpirun`` with one process per host of ``hostfile`` (DeepSpeed's default ``btl`` options)."""
    extra = shlex.split(launcher_args)
    has_if = any(a in ("-mca", "--mca") and b == "btl_tcp_if_include" for a, b in zip(extra, extra[1:]))
    cmd = ["mpirun", "-n", str(len(args.resources)), "--map-by", "ppr:1:node", "-hostfile", hostfile,
           "--mca", "btl", "^openib", *([] if has_if else ["--mca", "btl_tcp_if_include", "eth0"]), *extra]
    for k, v in {"UCX_TLS": "tcp", **exports}.items():
        cmd += ["-x", f"{k}={v}"]
    return [*cmd, *node_launch_argv(args, "env:" + NODE_RANK_ENV["openmpi"])]


def expand_first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: ``node[03-05,9],gpu1`` -> ``node03``."""
    text = nodelist.strip()
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", text)
    if match is None or not text:
        raise ValueError(f"cannot read a host from the SLURM node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def slurm_node(environ: Mapping[str, str]) -> tuple[int, int, str]:
    """``(nnodes, node_rank, master host)`` of this srun task from ``SLURM_*``."""
    try:
        nnodes = int(environ["SLURM_NNODES"])
        node_rank = int(environ["SLURM_NODEID"])
    except KeyError as e:
        raise ValueError(f"--launcher slurm inside an allocation needs {e.args[0]} (run under srun)") from None
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or environ.get("SLURM_STEP_NODELIST")
    if not nodelist:
        raise ValueError("--launcher slurm needs SLURM_JOB_NODELIST to find the master node (run under srun)")
    return nnodes, node_rank, expand_first_host(nodelist)
