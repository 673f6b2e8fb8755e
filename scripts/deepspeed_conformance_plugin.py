"""pytest plugin for ``scripts/deepspeed-conformance``: rename hook, harness patch, outcome record.

Loaded with ``-p deepspeed_conformance_plugin`` before DeepSpeed's conftest. Environment:
- ``ZS_CONFORMANCE_MODE``: ``zerospeed`` (install the ``deepspeed`` -> ``zerospeed`` rename hook) or
  ``deepspeed`` (import the installed DeepSpeed first, so the checkout's source tree cannot shadow it);
- ``ZS_CONFORMANCE_OUT``: JSON file that receives ``{nodeid: "passed"|"failed"|"skipped"}``;
- ``ZS_CONFORMANCE_TIMEOUT``: seconds one distributed test may run (default 180).

The harness patch touches DeepSpeed's ``DistributedExec`` only, never a test body, and is the same in
both modes: ranks are forked (warm imports, and the rename hook is inherited), and on a failing or hung
rank the pool is terminated and the test fails, instead of a destroy barrier that waits on the stuck
rank until Gloo's 30-minute timeout, or ``pytest.exit`` ending the whole run. A rank that fails through
``pytest.fail`` / ``pytest.raises`` fails its test at once with the message (``_run_rank``), not as a hang.

Every wait of the harness is bounded: the ranks' run (``ZS_CONFORMANCE_TIMEOUT``), the destroy barrier and the
pool's close after a test that passed (``_close_pool``: DeepSpeed waits on both without a limit, so a rank
that never reaches the barrier, or a worker that does not exit, held the whole area until its
``--area-timeout``), tearing a pool down (workers are killed, the pool's own ``terminate`` is given
``CLOSE_TIMEOUT``), and, as a last resort, the whole test (``pytest_runtest_call``: a SIGALRM at
``TEST_DEADLINE`` kills the test's ranks and fails it with the time).

Under DeepSpeed the C++ ops its tests JIT-build on first use (``deepspeed_shm_comm`` in every
``init_distributed`` on CPU, ``fused_adam`` for ``"type": "Adam"``) are built once here, before any test
(8 and 15 minutes on this loaded machine; cached in ``~/.cache/torch_extensions`` after that, a second
each). Built inside a test, the build outlives the per-test timeout: the rank is killed mid-build and
every later test waits on the build's lock file, which is how earlier recordings "hung".
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any

import pytest

MODE = os.environ.get("ZS_CONFORMANCE_MODE", "zerospeed")
TIMEOUT = float(os.environ.get("ZS_CONFORMANCE_TIMEOUT", "180"))
CLOSE_TIMEOUT = 30.0  # the destroy barrier and the pool's exit after a test
TEST_DEADLINE = 2 * TIMEOUT + 2 * CLOSE_TIMEOUT  # any test, whatever it waits on (last resort)

if MODE == "zerospeed":
    from zerospeed.testing import ds_rename

    ds_rename.install()
else:
    import deepspeed  # noqa: F401  # the installed one, before conftest puts the checkout on sys.path
    from deepspeed.accelerator import get_accelerator

    for _builder in ("ShareMemCommBuilder", "FusedAdamBuilder"):  # JIT builds outside any test's timeout
        _op = get_accelerator().create_op_builder(_builder)
        if _op is not None and deepspeed.ops.__compatible_ops__.get(_op.NAME, False):
            _op.load()

_OUTCOMES: dict[str, str] = {}


class _ForkMultiprocessing:
    """``torch.multiprocessing`` as the harness sees it, with every start method read as ``fork``."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def set_start_method(self, method: str, force: bool = False) -> None:
        self._real.set_start_method("fork", force=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class RankFailure(Exception):
    """A pytest outcome raised inside a rank, carried back to the parent as an ordinary exception."""


def _run_rank(run: Any, *args: Any) -> Any:
    """One rank of a distributed test. ``pytest.fail`` and ``pytest.raises``' "DID NOT RAISE" raise
    ``Failed``, a ``BaseException``: the pool's worker catches only ``Exception``, so the worker process died
    and its task never answered, and the test read as hung until the timeout (DeepSpeed's own harness waits
    forever there). Converted, the failure and its message come back at once."""
    try:
        return run(*args)
    except Exception:
        raise
    except BaseException as exc:  # noqa: B036  (pytest's outcomes, KeyboardInterrupt, SystemExit)
        raise RankFailure(f"{type(exc).__name__}: {exc}") from None


def _launch_daemonic_procs(self: Any, num_procs: int, init_method: str) -> None:
    """DeepSpeed's pool launch, with a failing or hung rank ending only its own test."""
    common = _common()
    mp = common.mp
    if self.reuse_dist_env:
        if num_procs not in self._pool_cache:
            self._pool_cache[num_procs] = mp.Pool(processes=num_procs)
        pool, master_port = self._pool_cache[num_procs], common.get_master_port()
    else:
        pool, master_port = mp.Pool(processes=num_procs), common.get_master_port()
    _LIVE.append(pool)
    args = [(self._dist_run, rank, num_procs, master_port, init_method) for rank in range(num_procs)]
    pending = pool.starmap_async(_run_rank, args)
    try:
        skip_msgs = pending.get(min(self.exec_timeout, TIMEOUT))
    except BaseException as exc:
        _abandon(pool)
        self._pool_cache.pop(num_procs, None)
        if isinstance(exc, mp.TimeoutError):
            pytest.fail(f"distributed test hung (> {min(self.exec_timeout, TIMEOUT):.0f} s)", pytrace=False)
        if isinstance(exc, RankFailure):
            pytest.fail(f"a rank failed: {exc}", pytrace=False)
        raise
    self._close_pool(pool, num_procs)
    if any(skip_msgs):
        pytest.skip(skip_msgs[0])


def _abandon(pool: Any) -> None:
    """Tear the pool down, bounded: its own ``terminate`` (SIGTERM to the workers, then joins), and SIGKILL for
    any worker still alive after a few seconds (a rank stuck in C code, or one that ignores SIGTERM), which
    also releases ``terminate``'s join. (Killing first would not do: an idle worker holds the task queue's
    lock while it waits, and ``terminate`` takes that lock.)"""
    workers = list(getattr(pool, "_pool", []))
    tidy = threading.Thread(target=lambda: (pool.terminate(), pool.join()), daemon=True)
    tidy.start()
    tidy.join(min(5.0, CLOSE_TIMEOUT))
    for proc in workers:
        if proc.pid is not None and proc.exitcode is None:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    tidy.join(CLOSE_TIMEOUT)


def _close_pool(self: Any, pool: Any, num_procs: int, force: bool = False) -> None:
    """DeepSpeed's close (the ranks' destroy barrier, then the pool's exit), each step bounded."""
    if not (force or not self.reuse_dist_env):
        return
    destroy = pool.starmap_async(self._dist_destroy, [() for _ in range(num_procs)])
    try:
        destroy.get(CLOSE_TIMEOUT)
    except BaseException as exc:
        _abandon(pool)
        if isinstance(exc, _common().mp.TimeoutError):
            pytest.fail(f"the ranks hung in the harness's destroy barrier after the test (> {CLOSE_TIMEOUT:.0f} s)",
                        pytrace=False)
        raise
    pool.close()
    exited = threading.Thread(target=pool.join, daemon=True)
    exited.start()
    exited.join(CLOSE_TIMEOUT)
    if exited.is_alive():
        _abandon(pool)
        pytest.fail(f"a rank's worker did not exit after the test (> {CLOSE_TIMEOUT:.0f} s; a non-daemon thread "
                    "left running?)", pytrace=False)


_LIVE: list[Any] = []  # the pools of the test now running (for the last-resort deadline)


class TestDeadlineExceeded(Exception):
    """A test ran past TEST_DEADLINE."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: Any) -> Any:
    """The last-resort bound on one test: SIGALRM at TEST_DEADLINE kills its ranks and fails it."""
    def expired(signum: int, frame: Any) -> None:
        for pool in _LIVE:
            _abandon(pool)
        raise TestDeadlineExceeded(f"the test ran past {TEST_DEADLINE:.0f} s (the conformance harness's bound)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, TEST_DEADLINE)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        _LIVE.clear()


def _common() -> Any:
    return sys.modules["unit.common"]


def patch_harness(common: Any) -> None:
    """Apply the harness patch to DeepSpeed's ``tests/unit/common.py`` module object."""
    if getattr(common, "_zs_patched", False):
        return
    common.mp = _ForkMultiprocessing(common.mp)
    common.DistributedExec._launch_daemonic_procs = _launch_daemonic_procs
    common.DistributedExec._close_pool = _close_pool
    common._zs_patched = True


def pytest_collection_modifyitems(session: Any, config: Any, items: list) -> None:
    if "unit.common" in sys.modules:
        patch_harness(sys.modules["unit.common"])


def pytest_runtest_logreport(report: Any) -> None:
    previous = _OUTCOMES.get(report.nodeid)
    if report.failed:
        _OUTCOMES[report.nodeid] = "failed"
    elif report.skipped and previous != "failed":
        _OUTCOMES[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed and previous is None:
        _OUTCOMES[report.nodeid] = "passed"
    if report.when == "teardown":
        _write()  # after every test: a run stopped by the area timeout keeps what it finished


def _write() -> None:
    out = os.environ.get("ZS_CONFORMANCE_OUT")
    if out:
        with open(out + ".tmp", "w") as f:
            json.dump(_OUTCOMES, f, indent=0, sort_keys=True)
        os.replace(out + ".tmp", out)


def pytest_collectreport(report: Any) -> None:
    if report.failed:  # a module that does not even import: all its tests count as failed
        _OUTCOMES[report.nodeid] = "collect-error"


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    _write()
