"""Faults on the wire of one test host (run inside its network namespace; nothing outside is touched).

- ``link_down``: ``ip link set eth0 down`` - the peers' packets go nowhere, the host's own sockets see
  "network unreachable";
- ``drop``: an ``iptables`` DROP of everything on eth0 - the link stays up and no RST ever arrives;
- ``netem``: ``tc qdisc ... netem`` on eth0 (``"delay 200ms"``); ``NetemUnavailable`` where the kernel has
  no netem qdisc (some VM kernels: the check is ``netem_available``);
- ``loss``: random packet loss on eth0, through netem where there is one, else an ``iptables`` rule
  (``-m statistic --mode random``) dropping that share of the packets both ways;
- ``block_ssh``: DROP of new connections to port 22 (a host that never answers ssh);
- ``shape``: a link of a chosen rate (and delay, with netem) for the bandwidth benchmarks.
"""

from __future__ import annotations

import os
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


class NetemUnavailable(RuntimeError):
    """This kernel has no netem queueing discipline."""


def netem_available(h: Host) -> bool:
    done = subprocess.run(["ip", "netns", "exec", h.netns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                           "delay", "1ms"], capture_output=True, text=True, timeout=30)
    if done.returncode == 0:
        _in(h, "tc", "qdisc", "del", "dev", "lo", "root")
    return done.returncode == 0


def netem(h: Host, spec: str) -> None:
    if not netem_available(h):
        raise NetemUnavailable(f"the kernel ({os.uname().release}) has no netem qdisc: cannot apply {spec!r}")
    _in(h, "tc", "qdisc", "replace", "dev", "eth0", "root", "netem", *spec.split())


def loss(h: Host, percent: float) -> None:
    if netem_available(h):
        _in(h, "tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "loss", f"{percent:g}%")
        return
    share = f"{percent / 100:.4f}"
    for chain, way in (("INPUT", "-i"), ("OUTPUT", "-o")):
        _in(h, "iptables", "-w", "-A", chain, way, "eth0", "-m", "statistic", "--mode", "random",
            "--probability", share, "-j", "DROP")


def block_ssh(h: Host) -> None:
    _in(h, "iptables", "-w", "-A", "INPUT", "-i", "eth0", "-p", "tcp", "--dport", "22", "-j", "DROP")


def shape(h: Host, rate: str, delay: str | None = None) -> str:
    """Limit what ``h`` sends on eth0 to ``rate`` (tc units: ``"1gbit"``), with ``delay`` (``"1ms"``) added
    where the kernel has netem; returns the qdisc applied. Without netem a delay raises ``NetemUnavailable``
    and the rate is a token bucket (``tbf``; its queue holds at most 100 ms of traffic)."""
    if netem_available(h):
        spec = ["netem", "rate", rate, *(["delay", delay] if delay else [])]
    elif delay:
        raise NetemUnavailable(f"the kernel ({os.uname().release}) has no netem qdisc: cannot add a {delay} delay")
    else:
        spec = ["tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]
    _in(h, "tc", "qdisc", "replace", "dev", "eth0", "root", *spec)
    return " ".join(spec)
