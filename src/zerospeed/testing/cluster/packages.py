"""Which programs a test cluster needs, and installing their Debian packages (only those missing).

A missing program is installed with ``apt-get install`` when we are root on a Debian-like system (CI here
is a fresh machine of that kind with Debian's mirror reachable); otherwise the caller gets the reason to
skip with. Nothing is installed when every program is already there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable

PACKAGE_OF = {  # program -> Debian package
    "ip": "iproute2", "tc": "iproute2", "nsenter": "util-linux", "unshare": "util-linux",
    "ssh": "openssh-client", "ssh-keygen": "openssh-client", "sshd": "openssh-server",
    "pdsh": "pdsh", "mpirun": "openmpi-bin", "iptables": "iptables",
    "munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd", "srun": "slurm-client",
    "sbatch": "slurm-client",
}
BASE_PROGRAMS = ("ip", "nsenter", "unshare", "ssh", "ssh-keygen", "sshd")
_SBIN = ("/usr/sbin", "/sbin")


def which(program: str) -> str | None:
    """``shutil.which`` that also looks in the sbin folders (not always on a non-login PATH)."""
    found = shutil.which(program)
    if found:
        return found
    for folder in _SBIN:
        path = os.path.join(folder, program)
        if os.access(path, os.X_OK):
            return path
    return None


def missing(programs: Iterable[str]) -> list[str]:
    return [p for p in programs if which(p) is None]


def ensure(programs: Iterable[str], timeout_s: float = 900.0) -> str | None:
    """Install the packages of the missing ``programs``; ``None`` when all are there, else why not."""
    absent = missing(programs)
    if not absent:
        return None
    packages = sorted({PACKAGE_OF.get(p, p) for p in absent})
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"missing {', '.join(absent)} (packages {' '.join(packages)}); not root with apt-get to install them"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    try:
        if subprocess.run(install, env=env, capture_output=True, timeout=timeout_s).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=timeout_s)
            done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout_s)
            if done.returncode != 0:
                return f"apt-get install {' '.join(packages)} failed: {done.stderr.strip()[-300:]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"apt-get install {' '.join(packages)} did not finish: {e}"
    still = missing(absent)
    return f"still missing after apt-get: {', '.join(still)}" if still else None
