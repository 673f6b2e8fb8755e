"""``Cluster``: N hosts on one machine, each a network namespace with its own address, name and sshd.

::

    with Cluster(2) as c:                       # node0 10.231.0.10, node1 10.231.0.11
        hostfile = c.write_hostfile(tmp / "hostfile", slots=2)
        proc = c.popen(0, ["zerospeed", "launch", "--hostfile", hostfile, "--launcher", "ssh", ...])
        c.kill_host(1)                           # or faults.drop(c.hosts[1]), faults.netem(...)

The file system is shared (as NFS would be); the network, host name, ``/etc/hosts`` and ssh configuration
are per host (netns.py, ssh.py). ``unavailable_reason()`` says why a cluster cannot be made here (not root,
no ``ip netns``, a program missing that apt-get could not install); tests skip with it. ``close()`` (also at
interpreter exit) kills every process on every host, removes the namespaces - with them the veths, the
bridge and the mounts - and the temp folder.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from . import packages, slurm, ssh
from .netns import Host, Network, kill_namespace, leftovers, namespace_pids, sweep_stale


class ClusterUnavailable(RuntimeError):
    """A test cluster cannot be made on this machine (the message says why)."""


def unavailable_reason(programs: Sequence[str] = packages.BASE_PROGRAMS, install: bool = True) -> str | None:
    """``None`` when a cluster can be made here (installing missing packages first unless ``install`` is
    false), else why not."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, sshd)"
    if packages.which("ip") is None:
        why = packages.ensure(["ip"])
        if why:
            return why
    probe = f"zscl-{os.getpid()}-probe"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return f"'ip netns add' does not work here: {done.stderr.strip()}"
    kill_namespace(probe)
    if not install:
        absent = packages.missing(programs)
        return f"missing {', '.join(absent)}" if absent else None
    return packages.ensure(programs)


class Cluster:
    """``n`` hosts (2..4 typical), named ``node0..``; a context manager."""

    def __init__(self, n: int = 2, names: Sequence[str] | None = None) -> None:
        if n < 1:
            raise ValueError(f"a cluster needs at least one host, got {n}")
        self.n = n
        self.names = list(names) if names is not None else [f"node{i}" for i in range(n)]
        self.run_dir = ""
        self.net: Network | None = None
        self.sshd: dict[int, subprocess.Popen[bytes]] = {}
        self.binds: dict[str, str] = {}
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.slurm_env: dict[str, str] | None = None

    @property
    def hosts(self) -> list[Host]:
        assert self.net is not None, "cluster not started"
        return self.net.hosts

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise ClusterUnavailable(reason)
        sweep_stale()
        self.run_dir = tempfile.mkdtemp(prefix="zerospeed-cluster-")
        os.chmod(self.run_dir, 0o755)
        atexit.register(self.close)
        try:
            self.net = Network(self.n, self.names, self.run_dir)
            self.net.create()
            client_config = ssh.write_keys(self.run_dir, self.net.hosts)
            hosts_file = os.path.join(self.run_dir, "hosts")
            with open(hosts_file, "w", encoding="utf-8") as f:
                f.write(self.net.hosts_file())
            self.binds = {hosts_file: "/etc/hosts", client_config: "/etc/ssh/ssh_config"}
            for h in self.net.hosts:
                self.net.start_holder(h, self.binds)
            for h in self.net.hosts:
                self.start_sshd(h.index)
            for h in self.net.hosts:
                self.wait_sshd(h.index)
        except BaseException:
            self.close()
            raise

    def start_sshd(self, index: int) -> None:
        h = self.hosts[index]
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation folder (as its package expects)
        config = ssh.sshd_config(self.run_dir, h)
        log = open(os.path.join(self.run_dir, f"sshd_{h.name}.log"), "ab")
        self.sshd[index] = subprocess.Popen(h.enter() + ssh.sshd_argv(packages.which("sshd") or "sshd", config),
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            start_new_session=True)
        log.close()

    def wait_sshd(self, index: int, timeout_s: float = 20.0) -> None:
        """Wait until ``ssh nodeI hostname`` works from node 0 and answers ``nodeI`` (keys, config, name
        resolution, and a session that runs on the host: its name, its files)."""
        deadline = time.monotonic() + timeout_s
        while True:
            done = self.run(0, ["ssh", self.names[index], "hostname"], timeout=timeout_s)
            if done.returncode == 0 and done.stdout.strip() == self.names[index]:
                return
            if self.sshd[index].poll() is not None and time.monotonic() < deadline:
                self.start_sshd(index)  # it could not bind yet (address still being set up): once more
            if time.monotonic() > deadline:
                log = os.path.join(self.run_dir, f"sshd_{self.names[index]}.log")
                with open(log, encoding="utf-8", errors="replace") as f:
                    said = f.read()[-1000:]
                raise RuntimeError(f"sshd on {self.names[index]} does not answer: {done.stderr.strip()} "
                                   f"(sshd exit code {self.sshd[index].poll()}, its log: {said!r})")
            time.sleep(0.1)

    def write_hostfile(self, path: str | os.PathLike[str], slots: int = 2, hosts: Sequence[int] | None = None) -> str:
        chosen = range(self.n) if hosts is None else hosts
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(f"{self.names[i]} slots={slots}\n" for i in chosen))
        return str(path)

    def popen(self, index: int, argv: Sequence[str], cwd: str | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on host ``index`` (its network, name and files)."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen([*self.hosts[index].enter(cwd), *argv], **kwargs)

    def run(self, index: int, argv: Sequence[str], cwd: str | None = None, timeout: float = 60.0,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.hosts[index].enter(cwd), *argv], capture_output=True, text=True,
                              timeout=timeout, **kwargs)

    def kill_host(self, index: int) -> None:
        """The host is gone: all its processes killed at once, its namespace and link removed."""
        assert self.net is not None
        self.net.kill_host(self.hosts[index])

    def reset_host(self, index: int) -> None:
        """Bring host ``index`` back fresh (after a fault): new namespace, link, holder and sshd."""
        assert self.net is not None
        h = self.hosts[index]
        self.net.kill_host(h)
        old = self.sshd.pop(index, None)
        if old is not None:
            old.wait(timeout=10)
        self.net.add_host(h)
        self.net.start_holder(h, self.binds)
        self.start_sshd(index)
        self.wait_sshd(index)

    def start_slurm(self) -> dict[str, str]:
        """munge, slurmctld on host 0, slurmd on each host (slurm.py); returns the environment for
        ``sbatch`` / ``srun`` (``SLURM_CONF``). Started once; raises ``ClusterUnavailable`` if not installable."""
        if self.slurm_env is not None:
            return self.slurm_env
        reason = packages.ensure(slurm.PROGRAMS)
        if reason is not None:
            raise ClusterUnavailable(reason)

        def spawn(index: int, argv: list[str], name: str, env: dict[str, str]) -> None:
            with open(os.path.join(self.run_dir, f"{name}.out"), "ab") as log:
                self.daemons.append(self.popen(index, argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=log))

        self.slurm_env = slurm.start(self.run_dir, self.hosts, spawn, self.run)
        return self.slurm_env

    def busy_pids(self, index: int) -> list[int]:
        """Processes on host ``index`` besides its holder, sshd listener and daemons (what a job left)."""
        assert self.net is not None
        keep = {p.pid for p in (self.hosts[index].holder, self.sshd.get(index), *self.daemons) if p is not None}
        # a daemon's own helpers (slurmctld's slurmscriptd) are not a job's; slurmd's children are (job steps)
        helpers = {p.pid for p in self.daemons if "slurmd" not in " ".join(map(str, p.args))}
        pids = namespace_pids(self.hosts[index].netns)
        return [pid for pid in pids if pid not in keep and not _descends_from(pid, helpers)]

    def close(self) -> None:
        if self.net is not None:
            self.net.close()
            self.net = None
        for proc in [*self.sshd.values(), *self.daemons]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        self.sshd.clear()
        self.daemons.clear()
        self.slurm_env = None
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = ""
        atexit.unregister(self.close)


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state letter
    except (OSError, ValueError, IndexError):
        return 0


def _descends_from(pid: int, ancestors: set[int]) -> bool:
    """Whether ``pid`` is a (grand)child of one of ``ancestors`` (slurmctld's slurmscriptd, say)."""
    seen = 0
    while pid > 1 and seen < 64:
        pid, seen = _parent(pid), seen + 1
        if pid in ancestors:
            return True
    return False


def free_port() -> int:
    """A port for ``--master_port`` (P and P + 1, the node watch, must be free on host 0). Every host's
    namespace starts empty, so any port below the ephemeral range is; a random one keeps runs apart."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return 20000 + s.getsockname()[1] % 10000


def remaining() -> list[str]:
    """What test clusters left behind: their namespaces (the veths and bridge live in them), mounts of a
    run folder in this mount namespace, processes still running from one."""
    left = [f"namespace {ns}" for ns in leftovers()]
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        left += [f"mount {line.split()[4]}" for line in f if "zerospeed-cluster-" in line]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if "zerospeed-cluster-" in cmd and int(pid) != os.getpid():
            left.append(f"process {pid}: {cmd[:120]}")
    return left
