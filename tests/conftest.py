"""Suite-wide settings: one intra-op thread per process, and how `make test` spreads the suite over 2 workers.

`make test` runs pytest-xdist with ``-n 2 --dist loadgroup``. Tests that start processes of their own (the
forked Gloo ranks of tests/dist, the hosts of tests/cluster, the GPU ranks of tests/gpu) form one group, so
they run one at a time on one worker, exactly as in a serial run: their ranks already fill both cores, and
timing-sensitive fault tests see the same machine they would alone. The in-process unit tests (one thread
each) are shared out over both workers, so the core a serial run leaves idle during them is used.
"""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

_PROCESS_DIRS = ("dist", "cluster", "gpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = os.path.dirname(__file__)
    for item in items:
        rel = os.path.relpath(str(item.path), root).split(os.sep)
        if rel[0] in _PROCESS_DIRS:
            item.add_marker(pytest.mark.xdist_group("processes"))
