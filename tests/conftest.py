"""Suite-wide settings: one intra-op thread per process, and how `make test` spreads the suite over 2 workers.

`make test` runs pytest-xdist with ``-n 2 --dist loadgroup``. A forked-rank test keeps both cores busy only
about half of its time (its ranks wait on each other's collectives, the parent waits on its ranks), so two
test files at once finish sooner than one after the other. Each test file is one group (its module
fixtures are built once, on one worker); all of tests/cluster is one group, since its session-wide test
cluster (network namespaces, sshd, slurm) must exist once per machine.
"""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = os.path.dirname(__file__)
    for item in items:
        rel = os.path.relpath(str(item.path), root)
        item.add_marker(pytest.mark.xdist_group("cluster" if rel.startswith("cluster" + os.sep) else rel))
