"""Faults on the wire of one test host (run inside its network namespace; nothing outside is touched).

- ``link_down``: ``ip link set eth0 down`` - the peers' packets go nowhere, the host's own sockets see
  "network unreachable";
- ``drop``: an ``iptables`` DROP of everything on eth0 - the link stays up and no RST ever arrives;
- ``netem``: ``tc qdisc ... netem`` on eth0 (``"delay 200ms"``, ``"loss 10%"``);
- ``block_ssh``: DROP of new connections to port 22 (a host that never answers ssh).
"""

from __future__ import annotations

import subprocess

from .netns import Host


def _in(h: Host, *argv: str) -> None:
    done = subprocess.run(["ip", "netns", "exec", h.netns, *argv], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} on {h.name} failed: {done.stderr.strip()}")


def link_down(h: Host) -> None:
    _in(h, "ip", "link", "set", "eth0", "down")


def link_up(h: Host) -> None:
    _in(h, "ip", "link", "set", "eth0", "up")


def drop(h: Host) -> None:
    _in(h, "iptables", "-w", "-A", "INPUT", "-i", "eth0", "-j", "DROP")
    _in(h, "iptables", "-w", "-A", "OUTPUT", "-o", "eth0", "-j", "DROP")


def netem(h: Host, spec: str) -> None:
    _in(h, "tc", "qdisc", "replace", "dev", "eth0", "root", "netem", *spec.split())


def block_ssh(h: Host) -> None:
    _in(h, "iptables", "-w", "-A", "INPUT", "-i", "eth0", "-p", "tcp", "--dport", "22", "-j", "DROP")
