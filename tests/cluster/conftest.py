"""One test cluster (3 hosts in network namespaces, sshd on each) for every test in tests/cluster.

Skipped with the reason where a cluster cannot be made (not root, no ``ip netns``, packages missing and
not installable). At the end of the session nothing it made may remain: no namespace (veths and bridge
live in them), no mount, no process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from zerospeed.testing.cluster import Cluster, packages, remaining, unavailable_reason

PROGRAMS = (*packages.BASE_PROGRAMS, "pdsh", "mpirun", "iptables", "tc")
SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    reason = unavailable_reason(PROGRAMS)
    if reason is not None:
        pytest.skip(f"no test cluster on this machine: {reason}")
    with Cluster(3) as c:
        yield c
    left = remaining()
    assert not left, f"the test cluster left these behind: {left}"


@pytest.fixture
def cluster_env() -> dict[str, str]:
    """The environment the user's shell on node0 has: this tree first on the path, one thread per rank."""
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env["PATH"] = f"{os.path.dirname(sys.executable)}:/usr/sbin:/usr/bin:/sbin:/bin"
    return env
