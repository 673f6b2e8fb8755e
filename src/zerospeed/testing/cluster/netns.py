"""Hosts as Linux network namespaces on one bridge: the network side of a test cluster.

::

    namespace zscl-<pid>-sw:   bridge br0 ── h0 ── h1 ── h2 ...   (no address: a switch)
                                         │     │
    namespace zscl-<pid>-h0:   lo, eth0 10.231.0.10/24      hostname node0 (own UTS namespace)
    namespace zscl-<pid>-h1:   lo, eth0 10.231.0.11/24      hostname node1

Each veth pair is created directly inside its two namespaces, so no interface, address or route ever
appears in the machine's own namespace, and the private range exists only inside namespaces made here:
traffic between hosts never leaves them. Each host has a *holder* process (``sleep``) that owns its UTS and
mount namespaces; in that mount namespace ``/etc/hosts`` (every host's name) and ``/etc/ssh/ssh_config`` are
bind-mounted from the run's temp folder. Everything a host runs is entered with ``nsenter`` on the
holder, so it sees that host's name, addresses and files. Killing a host's processes ends its mount and
UTS namespaces (the mounts go with them); deleting the network namespace ends its veth.

Namespaces are named after the creating process (``zscl-<pid>-...``): ``sweep_stale()`` removes those of
dead processes (a crashed earlier run), ``leftovers()`` lists what remains of any run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

PREFIX = "zscl-"
SUBNET = "10.231.0"
FIRST_HOST_OCTET = 10


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def list_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace(ns: str) -> None:
    """SIGKILL every process in ``ns``, wait for them, delete it (its veth ends go with it)."""
    for _ in range(50):
        pids = namespace_pids(ns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
    _ip("netns", "del", ns, check=False)


def _owner_alive(ns: str) -> bool:
    try:
        pid = int(ns[len(PREFIX):].split("-")[0])
    except ValueError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftovers() -> list[str]:
    """Namespaces of test clusters that still exist (any run's)."""
    return [ns for ns in list_namespaces() if ns.startswith(PREFIX)]


def sweep_stale() -> list[str]:
    """Remove the namespaces of runs whose process is gone (a crashed run); return their names."""
    stale = [ns for ns in leftovers() if not _owner_alive(ns)]
    for ns in stale:
        kill_namespace(ns)
    return stale


@dataclass
class Host:
    """One host: its index, name, address, network namespace and holder pid."""

    index: int
    name: str
    addr: str
    netns: str
    holder: subprocess.Popen[bytes] | None = None

    def enter(self, cwd: str | None = None) -> list[str]:
        """The ``nsenter`` prefix that runs a command on this host."""
        if self.holder is None:
            raise RuntimeError(f"host {self.name} is not running")
        wd = [f"--wd={cwd}"] if cwd else []
        return ["nsenter", "-t", str(self.holder.pid), "--net", "--uts", "--mount", *wd, "--"]


class Network:
    """Make the switch namespace and ``n`` hosts on it; ``close()`` removes all of it."""

    def __init__(self, n: int, names: Sequence[str], run_dir: str) -> None:
        self.tag = f"{PREFIX}{os.getpid()}-{int(time.time() * 1000) % 100000}"
        self.switch = f"{self.tag}-sw"
        self.run_dir = run_dir
        self.hosts = [Host(i, names[i], f"{SUBNET}.{FIRST_HOST_OCTET + i}", f"{self.tag}-h{i}") for i in range(n)]

    def hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost", *(f"{h.addr} {h.name}" for h in self.hosts)]
        return "\n".join(lines) + "\n"

    def create(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for h in self.hosts:
            self.add_host(h)

    def add_host(self, h: Host) -> None:
        _ip("netns", "add", h.netns)
        port = f"h{h.index}"
        # A fixed MAC per host: a host brought back (reset after a fault) is found at once, not after the
        # peers' ARP entries for its address go stale.
        mac = f"02:00:0a:e7:00:{FIRST_HOST_OCTET + h.index:02x}"
        _ip("link", "add", "eth0", "address", mac, "netns", h.netns, "type", "veth", "peer", "name", port,
            "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", h.netns, "link", "set", "lo", "up")
        _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
        _ip("-n", h.netns, "link", "set", "eth0", "up")

    def start_holder(self, h: Host, binds: dict[str, str], timeout_s: float = 20.0) -> None:
        """Start ``h``'s holder: new UTS + mount namespaces, its hostname, ``binds`` (src -> target)."""
        ready = os.path.join(self.run_dir, f"{h.name}.ready")
        # A host brought back must not find the file its previous holder left: nsenter would enter this
        # holder before it has its own names and mounts (the machine's /etc/hosts, its host name).
        if os.path.exists(ready):
            os.remove(ready)
        mounts = "".join(f"mount --bind '{src}' '{dst}' && " for src, dst in binds.items())
        script = f"hostname '{h.name}' && {mounts}touch '{ready}' && exec sleep 2147483647"
        # nsenter --net, not `ip netns exec`: that one remounts /sys, hiding the cgroup tree slurmd needs.
        h.holder = subprocess.Popen(["nsenter", f"--net=/run/netns/{h.netns}", "unshare", "--uts", "--mount",
                                     "--propagation", "private", "--", "sh", "-c", script],
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(ready):
            if h.holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"host {h.name}: holder did not start (exit {h.holder.poll()})")
            time.sleep(0.02)
        # nsenter execs unshare, which execs sh, which execs sleep: the holder's pid is the Popen pid.

    def kill_host(self, h: Host) -> None:
        """The host dies: every process in it is SIGKILLed and its namespace (and veth) removed."""
        kill_namespace(h.netns)
        # The kernel frees a deleted namespace (and the veth in it) asynchronously: delete the switch's end
        # now, so that a host brought back can make its link again at once.
        _ip("-n", self.switch, "link", "del", f"h{h.index}", check=False)
        if h.holder is not None:
            h.holder.wait(timeout=10)
            h.holder = None

    def close(self) -> None:
        for h in self.hosts:
            self.kill_host(h)
        kill_namespace(self.switch)
