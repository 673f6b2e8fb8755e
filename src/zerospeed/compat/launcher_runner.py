"""``deepspeed.launcher.runner``: the ``deepspeed`` command's parsing helpers and ``main``, over zerospeed's
launcher (``launcher/hostfile.py``, ``launcher/multinode.py``, ``launcher/launch.py``).

Errors are ``ValueError`` subclasses (``HostfileError``, ``UsageError``), as DeepSpeed raises ``ValueError``.
``main(args)`` is ``zerospeed launch`` with DeepSpeed's flags; the per-backend runner classes of
``deepspeed.launcher.multinode_runner`` are not served (zerospeed builds its own per-node commands).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from ..launcher import launch
from ..launcher.hostfile import Resources, filter_resources, parse_hostfile, read_hostfile
from ..launcher.multinode import decode_world_info, encode_world_info

_parse_hostfile = parse_hostfile
fetch_hostfile = read_hostfile


def parse_resource_filter(host_info: Mapping[str, list[int]], include_str: str = "",
                          exclude_str: str = "") -> Resources:
    """``host_info`` ({host: [slots]}) after one of ``--include`` / ``--exclude``."""
    return filter_resources(host_info, include_str, exclude_str)


def parse_inclusion_exclusion(resource_pool: Mapping[str, int], inclusion: str, exclusion: str) -> Resources:
    """The hostfile's ``{host: slot count}`` as ``{host: [slots]}`` after ``--include`` / ``--exclude``."""
    return filter_resources({host: list(range(n)) for host, n in resource_pool.items()}, inclusion, exclusion)


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """DeepSpeed's launcher flags (``zerospeed launch``'s parser, which takes them)."""
    parser = argparse.ArgumentParser(prog="deepspeed")
    launch.add_arguments(parser)
    return parser.parse_args(None if args is None else list(args))


def main(args: Sequence[str] | None = None) -> int:
    """Run ``deepspeed ARGS`` as ``zerospeed launch ARGS``; a usage error raises (a ``ValueError``)."""
    return launch.run(parse_args(args))


__all__ = ["_parse_hostfile", "decode_world_info", "encode_world_info", "fetch_hostfile", "main", "parse_args",
           "parse_inclusion_exclusion", "parse_resource_filter"]
