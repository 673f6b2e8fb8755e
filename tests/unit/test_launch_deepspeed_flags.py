"""DeepSpeed's launcher defaults: --local_rank passed unless --no_local_rank; --bind_cores_to_rank splits cores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zerospeed.launcher import cli, launch, multinode, rank_entry

SCRIPT = Path(__file__)


def _plan(*flags: str) -> launch.LaunchPlan:
    return launch.plan_from_args(cli.build_parser().parse_args(["launch", "--num_gpus", "2", *flags, str(SCRIPT)]))


def test_local_rank_is_passed_by_default_and_no_local_rank_turns_it_off() -> None:
    assert _plan().pass_local_rank
    assert launch.rank_env(_plan(), "/tmp/x", base={})[rank_entry.PASS_LOCAL_RANK_ENV] == "1"
    assert not _plan("--no_local_rank").pass_local_rank
    assert launch.rank_env(_plan("--no_local_rank"), "/tmp/x", base={})[rank_entry.PASS_LOCAL_RANK_ENV] == "0"


def test_bind_cores_to_rank_reaches_each_rank() -> None:
    assert rank_entry.BIND_CORES_ENV not in launch.rank_env(_plan(), "/tmp/x", base={})
    assert launch.rank_env(_plan("--bind_cores_to_rank"), "/tmp/x", base={})[rank_entry.BIND_CORES_ENV] == ""
    plan = _plan("--bind_cores_to_rank", "--bind_core_list", "0-3,8")
    assert launch.rank_env(plan, "/tmp/x", base={})[rank_entry.BIND_CORES_ENV] == "0-3,8"
    with pytest.raises(launch.UsageError, match="bad range"):
        _plan("--bind_cores_to_rank", "--bind_core_list", "3-1")


def test_core_split_is_deepspeeds() -> None:
    cores = rank_entry.parse_core_list("0-3,8,10-12")
    assert cores == [0, 1, 2, 3, 8, 10, 11, 12]
    assert [rank_entry.cores_for_rank(cores, r, 3) for r in range(3)] == [[0, 1], [2, 3], [8, 10]]
    with pytest.raises(ValueError, match="cannot be shared"):
        rank_entry.cores_for_rank([0], 0, 2)


def test_a_rank_pins_itself_and_sets_omp_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[int]] = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: calls.append(sorted(cores)))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    rank_entry._bind_cores("")
    assert calls == [[2, 3]] and os.environ["OMP_NUM_THREADS"] == "2"


def test_multinode_node_command_keeps_no_local_rank() -> None:
    assert "--no_local_rank" not in multinode.node_launch_argv(multinode.NodeArgs(target="t.py"), "0")
    assert "--no_local_rank" in multinode.node_launch_argv(multinode.NodeArgs(target="t.py", pass_local_rank=False), "0")


def test_a_missing_deepspeed_module_names_the_fix() -> None:
    err = ModuleNotFoundError("No module named 'deepspeed'", name="deepspeed")
    rank_entry._hint_deepspeed_import(err)
    assert str(err).startswith("No module named 'deepspeed'. ") and "zerospeed alias install" in str(err)
    other = ModuleNotFoundError("No module named 'foo'", name="foo")
    rank_entry._hint_deepspeed_import(other)
    assert str(other) == "No module named 'foo'"


def test_with_the_alias_active_a_missing_path_is_named_as_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    alias = types.ModuleType("deepspeed")
    alias.__zerospeed_alias__ = True  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed", alias)
    err = ModuleNotFoundError("No module named 'deepspeed.foo'", name="deepspeed.foo")
    rank_entry._hint_deepspeed_import(err)
    assert "zerospeed does not serve DeepSpeed's module 'deepspeed.foo' yet" in str(err)


def test_multinode_node_command_forwards_core_binding() -> None:
    argv = multinode.node_launch_argv(multinode.NodeArgs(target="t.py", bind_cores="0-3"), "0")
    assert argv[argv.index("--bind_cores_to_rank"):argv.index("t.py")] == ["--bind_cores_to_rank", "--bind_core_list",
                                                                           "0-3"]
    assert "--bind_cores_to_rank" not in multinode.node_launch_argv(multinode.NodeArgs(target="t.py"), "0")
