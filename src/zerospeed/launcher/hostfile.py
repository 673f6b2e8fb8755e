"""DeepSpeed's hostfile and ``--include`` / ``--exclude`` filters, as pure functions.

A hostfile lists one host per line, ``worker-0 slots=4``; ``#`` starts a comment line, blank lines are
skipped, a host may appear once. A filter is ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC =
NAME[:SLOT[,SLOT ...]]``: ``--include`` keeps only what it names (a bare name: all of that host's slots),
``--exclude`` removes it. ``--num_nodes`` keeps the first N hosts and ``--num_gpus`` the first N slots of
each. Host order (which decides node ranks) is always the hostfile's. Semantics and error messages follow
DeepSpeed's ``launcher/runner.py``; errors name the hostfile line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

Resources = dict[str, list[int]]  # host -> slot (device) indices, in hostfile order

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")


class HostfileError(ValueError):
    """The hostfile or an include/exclude filter is malformed or names what the hostfile lacks."""


def parse_hostfile(lines: Iterable[str], source: str = "hostfile") -> dict[str, int]:
    """``{host: slots}`` in file order; ``HostfileError`` naming ``source:line`` for a bad or repeated entry."""
    pool: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.search(line)
        if match is None:
            raise HostfileError(f"{source}:{number}: bad entry {line!r}; expected 'HOST slots=N'")
        host = match.group(1)
        if host in pool:
            raise HostfileError(f"{source}:{number}: host {host!r} is listed twice (multiple entries for {host})")
        pool[host] = int(match.group(2))
    if not pool:
        raise HostfileError(f"{source} is empty or not formatted correctly (no 'HOST slots=N' line)")
    return pool


def read_hostfile(path: str) -> dict[str, int] | None:
    """Parse the hostfile at ``path``; ``None`` if there is no such file (DeepSpeed: run on this node only)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return None
    return parse_hostfile(lines, source=path)


def _parse_filter(spec: str) -> dict[str, list[int]]:
    """``"a:0,1@b"`` -> ``{"a": [0, 1], "b": []}`` (repeated hosts merge; slots sorted, unique)."""
    out: dict[str, list[int]] = {}
    for node in spec.split("@"):
        host, sep, slots = node.partition(":")
        try:
            values = [int(s) for s in slots.split(",")] if sep else []
        except ValueError:
            raise HostfileError(f"bad slot list in {node!r}: expected NAME:SLOT[,SLOT...] with integer slots")
        out[host] = sorted(set(out.get(host, []) + values))
    return out


def filter_resources(hosts: Mapping[str, list[int]], include: str = "", exclude: str = "") -> Resources:
    """Apply one of ``include`` / ``exclude`` (mutually exclusive) to ``hosts``; hosts left empty are dropped."""
    if include and exclude:
        raise HostfileError("--include and --exclude are mutually exclusive")
    if not include and not exclude:
        return {h: list(s) for h, s in hosts.items()}
    kept: Resources = {} if include else {h: list(s) for h, s in hosts.items()}
    for host, slots in _parse_filter(include or exclude).items():
        if host not in hosts:
            raise HostfileError(f"Hostname '{host}' not found in hostfile")
        for slot in slots:
            if slot not in hosts[host]:
                raise HostfileError(f"No slot '{slot}' specified on host '{host}'")
        if include:
            kept[host] = list(slots) if slots else list(hosts[host])
        else:
            kept[host] = [s for s in kept[host] if s not in slots] if slots else []
    return {h: list(dict.fromkeys(kept[h])) for h in hosts if kept.get(h)}


def active_resources(pool: Mapping[str, int], include: str = "", exclude: str = "", num_nodes: int = -1,
                     num_gpus: int = -1) -> Resources:
    """The hosts and slots to run on: the filter, then the first ``num_nodes`` hosts / ``num_gpus`` slots."""
    if (num_nodes >= 0 or num_gpus >= 0) and (include or exclude):
        raise HostfileError("Cannot specify --num_nodes/--num_gpus with --include/--exclude")
    resources = filter_resources({h: list(range(n)) for h, n in pool.items()}, include, exclude)
    if num_nodes > 0:
        resources = dict(list(resources.items())[:num_nodes])
    if num_gpus > 0:
        resources = {h: list(range(num_gpus)) for h in resources}
    if not resources:
        raise HostfileError("no host left to run on after --include/--exclude")
    return resources
