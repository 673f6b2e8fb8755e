"""scripts/deepspeed-conformance without DeepSpeed: the rename hook, the area names, the P-of-N table."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from zerospeed.testing import ds_rename

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
conformance = importlib.import_module("deepspeed_conformance")


@pytest.fixture
def hook():
    if "deepspeed" in sys.modules and not sys.modules["deepspeed"].__name__.startswith("zerospeed"):
        pytest.skip("the real deepspeed is imported in this process")
    ds_rename.install()
    yield
    ds_rename.uninstall()


def test_rename_gives_the_same_module_objects(hook):
    import zerospeed
    import zerospeed.comm

    deepspeed = importlib.import_module("deepspeed")
    dist = importlib.import_module("deepspeed.comm")
    assert deepspeed is zerospeed and dist is zerospeed.comm
    assert zerospeed.comm.__spec__.name == "zerospeed.comm"  # the target module keeps its own spec
    pipe = importlib.import_module("deepspeed.pipe")  # an alias-table path, renamed like any other
    assert pipe.PipelineModule is importlib.import_module("zerospeed.pipe").PipelineModule


def test_missing_path_names_the_deepspeed_module(hook):
    with pytest.raises(ModuleNotFoundError) as err:
        importlib.import_module("deepspeed.no_such_module_here")
    assert err.value.name == "deepspeed.no_such_module_here"
    assert "zerospeed does not serve" in str(err.value)


def test_uninstall_forgets_the_deepspeed_names(hook):
    importlib.import_module("deepspeed.comm")
    ds_rename.uninstall()
    assert "deepspeed.comm" not in sys.modules
    assert ds_rename.renamed("deepspeedx") is None and ds_rename.renamed("deepspeed.a") == "zerospeed.a"
    ds_rename.install()


def test_area_names():
    assert conformance.area_of("unit/runtime/zero/test_zero.py::TestX::test_y[1]") == "runtime/zero"
    assert conformance.area_of("unit/runtime/test_ds_config_dict.py::t") == "runtime"
    assert conformance.area_of("unit/ops/adam/test_cpu_adam.py::t") == "ops"
    assert conformance.area_of("unit/v1/zero/test_x.py::t") == "v1/zero"
    assert conformance.area_of("unit/test_top.py::t") == "unit"


def test_tally_counts_only_reference_passes():
    reference = ["unit/launcher/a.py::t1", "unit/launcher/a.py::t2", "unit/ops/b.py::t3", "unit/ops/b.py::t4"]
    outcomes = {"unit/launcher/a.py::t1": "passed", "unit/launcher/a.py::t2": "failed",
                "unit/ops/b.py::t3": "skipped", "unit/ops/new.py::t9": "passed"}  # t9: DeepSpeed did not pass it
    rows = conformance.tally(reference, outcomes)
    assert rows["launcher"] == {"N": 2, "P": 1, "failed": 1, "skipped": 0, "not run": 0}
    assert rows["ops"] == {"N": 2, "P": 0, "failed": 0, "skipped": 1, "not run": 1}
    assert conformance.format_table(rows).splitlines()[-1] == "DeepSpeed unit tests under zerospeed: 1 of 4"
    only_ops = conformance.tally(reference, outcomes, areas=["ops"])
    assert list(only_ops) == ["ops"]


def test_read_ids_skips_comments(tmp_path):
    f = tmp_path / "ids.txt"
    f.write_text("# header\n\nunit/a.py::t\n  unit/b.py::u  \n")
    assert conformance.read_ids(f) == ["unit/a.py::t", "unit/b.py::u"]


def test_an_area_past_its_time_takes_its_forked_ranks_with_it(tmp_path):
    import os
    import time

    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    with open(tmp_path / "log", "w") as log:
        start = time.monotonic()
        finished = conformance.run_bounded([sys.executable, "-c", script], tmp_path, dict(os.environ), log, 1.0)
    assert not finished and time.monotonic() - start < 30
    child = int(pid_file.read_text())
    for _ in range(50):  # the grandchild is killed with the session (a zombie until init reaps it)
        try:
            if Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the forked child outlived the area timeout")


def test_record_with_a_selection_keeps_the_rest_of_the_area(tmp_path):
    path = tmp_path / "passing.txt"
    path.write_text("unit/comm/test_a.py::t1\nunit/comm/test_a.py::t2\nunit/utils/test_b.py::t\n")
    conformance.record({"unit/comm/test_a.py::t2": "failed", "unit/comm/test_a.py::t3": "passed"}, ["comm"],
                       selected=True, path=path)
    assert conformance.read_ids(path) == ["unit/comm/test_a.py::t1", "unit/comm/test_a.py::t3",
                                          "unit/utils/test_b.py::t"]
    conformance.record({"unit/comm/test_a.py::t9": "passed"}, ["comm"], path=path)  # a whole-area run replaces it
    assert conformance.read_ids(path) == ["unit/comm/test_a.py::t9", "unit/utils/test_b.py::t"]


class _FakeExec:
    """What the harness patch reads of DeepSpeed's ``DistributedExec``: one rank whose test body fails the way
    ``pytest.raises`` does when nothing is raised (``Failed``, a ``BaseException``)."""

    reuse_dist_env = False
    exec_timeout = 10
    _pool_cache: dict = {}

    def _dist_run(self, rank: int, num_procs: int, master_port: int, init_method: str) -> None:
        pytest.fail("DID NOT RAISE NotImplementedError")

    def _close_pool(self, pool, num_procs) -> None:
        pool.close()
        pool.join()


def test_a_rank_failing_through_pytest_fails_at_once_not_as_a_hang(hook, monkeypatch):
    """The pool's worker died on pytest's BaseException and never answered: the test read as hung after the
    timeout (DeepSpeed's TestOptimizerImplementation stage-0 cases). Now the failure comes back with its reason."""
    import multiprocessing
    import time
    import types

    plugin = importlib.import_module("deepspeed_conformance_plugin")
    common = types.SimpleNamespace(mp=multiprocessing.get_context("fork"), get_master_port=lambda: 29999)
    monkeypatch.setitem(sys.modules, "unit.common", common)
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE NotImplementedError"):
        plugin._launch_daemonic_procs(_FakeExec(), 1, "tcp://127.0.0.1:29999")
    assert time.monotonic() - start < 8


class _StuckAfterTheTest(_FakeExec):
    """A test that passed, then its rank never leaves the harness's destroy barrier, or its worker never exits."""

    def __init__(self, where: str) -> None:
        self.where = where

    def _dist_run(self, rank: int, num_procs: int, master_port: int, init_method: str) -> str:
        if self.where == "exit":  # a non-daemon thread left running: the pool's worker cannot exit
            import threading
            import time

            threading.Thread(target=time.sleep, args=(60,)).start()
        return ""

    def _dist_destroy(self) -> None:
        if self.where == "barrier":
            import time

            time.sleep(60)


@pytest.mark.parametrize("where", ["barrier", "exit"])
def test_a_rank_stuck_after_its_test_fails_it_in_bounded_time(hook, monkeypatch, where):
    """DeepSpeed's _close_pool waits on the destroy barrier and the pool's exit without a limit (the "hang"
    of comm/test_dist.py::TestDistInitWithModel::test_no_init[True] in an earlier whole-tree run)."""
    import multiprocessing
    import time
    import types

    plugin = importlib.import_module("deepspeed_conformance_plugin")
    monkeypatch.setattr(plugin, "CLOSE_TIMEOUT", 1.0)
    common = types.SimpleNamespace(mp=multiprocessing.get_context("fork"), get_master_port=lambda: 29999)
    monkeypatch.setitem(sys.modules, "unit.common", common)
    stuck = _StuckAfterTheTest(where)
    stuck._close_pool = types.MethodType(plugin._close_pool, stuck)
    start = time.monotonic()
    match = "destroy barrier" if where == "barrier" else "did not exit"
    with pytest.raises(pytest.fail.Exception, match=match):
        plugin._launch_daemonic_procs(stuck, 1, "tcp://127.0.0.1:29999")
    assert time.monotonic() - start < 8


def test_any_test_past_the_deadline_fails(monkeypatch):
    import time

    plugin = importlib.import_module("deepspeed_conformance_plugin")
    monkeypatch.setattr(plugin, "TEST_DEADLINE", 0.5)
    wrapper = plugin.pytest_runtest_call(None)
    next(wrapper)
    start = time.monotonic()
    with pytest.raises(plugin.TestDeadlineExceeded, match="ran past 0 s|ran past 1 s"):
        time.sleep(10)
    assert time.monotonic() - start < 5
    with pytest.raises(StopIteration):
        next(wrapper)
