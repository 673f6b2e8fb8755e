"""SLURM on a test cluster: one munged (its socket on the shared file system), slurmctld on host 0, slurmd on
every host, all from one ``slurm.conf`` in the run's temp folder (``SLURM_CONF`` names it).

No cgroups, no accounting: ``proctrack/linuxproc``, ``task/none``, ``select/cons_tres`` by CPU. Every
daemon runs in the foreground inside its host (netns.py), so it dies with the host and at teardown.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import packages
from .netns import Host

PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sbatch")
CPUS_PER_NODE = 2


def write_config(run_dir: str, hosts: Sequence[Host]) -> dict[str, str]:
    """Write the munge key and ``slurm.conf``; return the environment every SLURM command needs."""
    sdir = os.path.join(run_dir, "slurm")
    for sub in ("state", *(f"spool-{h.name}" for h in hosts)):
        os.makedirs(os.path.join(sdir, sub), exist_ok=True)
    key = os.path.join(sdir, "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    sock = os.path.join(sdir, "munge.sock")
    nodes = "".join(f"NodeName={h.name} NodeAddr={h.addr} CPUs={CPUS_PER_NODE} State=UNKNOWN\n" for h in hosts)
    conf = os.path.join(sdir, "slurm.conf")
    with open(conf, "w", encoding="utf-8") as f:
        f.write(
            f"ClusterName=zerospeedtest\nSlurmctldHost={hosts[0].name}({hosts[0].addr})\n"
            "SlurmctldPort=6817\nSlurmdPort=6818\nSlurmUser=root\nSlurmdUser=root\n"
            f"AuthType=auth/munge\nAuthInfo=socket={sock}\nCredType=cred/munge\n"
            f"StateSaveLocation={sdir}/state\nSlurmdSpoolDir={sdir}/spool-%n\n"
            f"SlurmctldPidFile={sdir}/slurmctld.pid\nSlurmdPidFile={sdir}/slurmd-%n.pid\n"
            f"SlurmctldLogFile={sdir}/slurmctld.log\nSlurmdLogFile={sdir}/slurmd-%n.log\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSelectType=select/cons_tres\n"
            "SelectTypeParameters=CR_CPU\nSchedulerType=sched/builtin\nMpiDefault=none\nReturnToService=2\n"
            "JobCompType=jobcomp/none\nAccountingStorageType=accounting_storage/none\n"
            "JobAcctGatherType=jobacct_gather/none\nSlurmdTimeout=10\nMessageTimeout=5\nKillWait=3\n"
            "InactiveLimit=0\nMinJobAge=5\n"
            f"{nodes}PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n"
        )
    return {"SLURM_CONF": conf, "MUNGE_SOCKET": sock, "ZS_SLURM_DIR": sdir}


def start(run_dir: str, hosts: Sequence[Host], spawn: Callable[..., Any], run: Callable[..., Any],
          timeout_s: float = 60.0) -> dict[str, str]:
    """Start munged and slurmctld on host 0 and slurmd on each host; wait until every node is idle."""
    env = {**os.environ, **write_config(run_dir, hosts)}
    sdir = env["ZS_SLURM_DIR"]
    spawn(0, [packages.which("munged") or "munged", "-F", "-f", f"--socket={env['MUNGE_SOCKET']}",
              f"--key-file={sdir}/munge.key", f"--pid-file={sdir}/munged.pid", f"--log-file={sdir}/munged.log",
              f"--seed-file={sdir}/munged.seed"], "munged", env)
    _wait(lambda: os.path.exists(env["MUNGE_SOCKET"]), timeout_s, "munged did not start", f"{sdir}/munged.log")
    spawn(0, [packages.which("slurmctld") or "slurmctld", "-D", "-i"], "slurmctld", env)
    for h in hosts:
        spawn(h.index, [packages.which("slurmd") or "slurmd", "-D", "-N", h.name], f"slurmd-{h.name}", env)

    def idle() -> bool:
        done = run(0, ["sinfo", "-h", "-N", "-o", "%N %t"], env=env, timeout=10)
        states = [line.split()[1] for line in done.stdout.splitlines() if line.strip()]
        return len(states) == len(hosts) and all(s.startswith("idle") for s in states)

    _wait(idle, timeout_s, "slurm nodes did not become idle", f"{sdir}/slurmctld.log")
    return env


def _wait(ok: Callable[[], bool], timeout_s: float, what: str, log: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            try:
                with open(log, encoding="utf-8", errors="replace") as f:
                    tail = f.read()[-1500:]
            except OSError:
                tail = "(no log)"
            raise RuntimeError(f"{what} within {timeout_s:.0f} s; {log}: {tail}")
        time.sleep(0.2)


def run_subprocess(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, **kwargs)
