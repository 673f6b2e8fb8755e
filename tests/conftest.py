"""Suite-wide settings: one intra-op thread per process; `make test` spreads the test files over 2 workers.

`make test` runs pytest-xdist with ``-n 2 --dist loadfile``. A forked-rank test keeps both cores busy only
about half of its time (its ranks wait on each other's collectives, the parent waits on its ranks), so two
test files at once finish sooner than one after the other (measured: see docs/architecture.md, Tests). Each
file runs on one worker, so its module fixtures are built once; tests/cluster is one file, since its
session-wide test cluster (network namespaces, sshd, slurm) must exist once per machine.
(``--dist loadgroup`` would group by marker, but pytest-xdist 3.8 sets the group on a node id that pytest 9
no longer reads, so it groups nothing there.)
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
