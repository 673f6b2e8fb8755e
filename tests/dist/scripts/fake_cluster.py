"""Stand-ins for ``pdsh``, ``srun`` and ``mpirun`` that run every "host's" task here, for two simulated nodes.

Installed by tests/dist/test_multinode.py as executables named after the real programs. Each reads the
arguments zerospeed's fan-out passes (and rejects any it does not know, so a changed command line fails the
test), starts one task per node with what the real program gives it (pdsh: ``%n`` replaced by the host's
index; srun: ``SLURM_NODEID``/``SLURM_NNODES``/``SLURM_JOB_NODELIST`` and ``--export``; mpirun:
``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE`` and ``-x``), waits for all and exits with the largest code.
"""

from __future__ import annotations

import os
import subprocess
import sys


def _run_all(tasks: list[tuple[list[str], dict[str, str]]]) -> int:
    procs = [subprocess.Popen(argv, env=env) for argv, env in tasks]
    return max(p.wait() for p in procs)


def pdsh(args: list[str]) -> int:
    hosts: list[str] = []
    while args[0].startswith("-"):
        flag = args.pop(0)
        if flag == "-S":
            continue
        if flag == "-f":
            args.pop(0)
        elif flag == "-w":
            hosts = args.pop(0).split(",")
        else:
            raise SystemExit(f"fake pdsh: unknown flag {flag}")
    command = " ".join(args)
    return _run_all([(["bash", "-c", command.replace("%n", str(i))], dict(os.environ)) for i in range(len(hosts))])


def srun(args: list[str]) -> int:
    n, exports, nodelist = 0, {}, "node-a,node-b"
    while args[0].startswith("-"):
        flag = args.pop(0)
        if flag == "-n":
            n = int(args.pop(0))
        elif flag in ("--nodelist", "--nodes", "--comment"):
            value = args.pop(0)
            nodelist = value if flag == "--nodelist" else nodelist
        elif flag.startswith("--export="):
            parts = flag[len("--export="):].split(",")
            if parts[0] != "ALL":
                raise SystemExit(f"fake srun: expected --export=ALL,..., got {flag}")
            exports = dict(p.split("=", 1) for p in parts[1:])
        elif flag != "--ntasks-per-node=1":
            raise SystemExit(f"fake srun: unknown flag {flag}")
    base = {**os.environ, **exports, "SLURM_NNODES": str(n), "SLURM_JOB_NODELIST": nodelist}
    return _run_all([(args, {**base, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i)}) for i in range(n)])


def mpirun(args: list[str]) -> int:
    n, exports = 0, {}
    while args[0].startswith("-"):
        flag = args.pop(0)
        if flag == "-n":
            n = int(args.pop(0))
        elif flag in ("--map-by", "-hostfile"):
            args.pop(0)
        elif flag == "--mca":
            args[:2] = []
        elif flag == "-x":
            key, value = args.pop(0).split("=", 1)
            exports[key] = value
        else:
            raise SystemExit(f"fake mpirun: unknown flag {flag}")
    base = {**os.environ, **exports, "OMPI_COMM_WORLD_SIZE": str(n)}
    return _run_all([(args, {**base, "OMPI_COMM_WORLD_RANK": str(i)}) for i in range(n)])


if __name__ == "__main__":
    program = os.path.basename(sys.argv[0])
    sys.exit({"pdsh": pdsh, "srun": srun, "mpirun": mpirun}[program](sys.argv[1:]))
