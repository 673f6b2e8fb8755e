"""One test cluster (3 hosts in network namespaces, sshd on each) for every test in tests/cluster (one
module, test_cluster.py: `make test` runs each file on one xdist worker, and the cluster must exist once).

Skipped with the reason where a cluster cannot be made (not root, no ``ip netns``, packages missing and
not installable). At the end of the session nothing it made may remain: no namespace (veths and bridge
live in them), no mount, no process.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from zerospeed.testing.cluster import Cluster, packages, remaining, unavailable_reason

PROGRAMS = (*packages.BASE_PROGRAMS, "pdsh", "mpirun", "iptables", "tc")
STEPS = 2
# The suite's budget: the tests that repeat what another already covers run with ZEROSPEED_CLUSTER_FULL=1.
full_only = pytest.mark.skipif(os.environ.get("ZEROSPEED_CLUSTER_FULL") != "1",
                               reason="set ZEROSPEED_CLUSTER_FULL=1 (30-60 s more each on 2 cores)")
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}: tearing the test cluster down")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    reason = unavailable_reason(PROGRAMS)
    if reason is not None:
        pytest.skip(f"no test cluster on this machine: {reason}")
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _interrupt)  # a killed test run still tears the cluster down
    try:
        with Cluster(3) as c:
            yield c
    finally:
        signal.signal(signal.SIGTERM, previous)
    left = remaining()
    assert not left, f"the test cluster left these behind: {left}"


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The 4-rank single-host losses of mn_train.py (forked ranks), STEPS steps."""
    from tests.cluster.common import reference_losses

    return reference_losses(tmp_path_factory.mktemp("ref"), STEPS)


@pytest.fixture
def cluster_env() -> dict[str, str]:
    """The environment the user's shell on node0 has: this tree first on the path, one thread per rank."""
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env["PATH"] = f"{os.path.dirname(sys.executable)}:/usr/sbin:/usr/bin:/sbin:/bin"
    return env
