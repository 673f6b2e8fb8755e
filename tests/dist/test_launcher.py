"""``zerospeed launch``: ranks get torchrun's env; a failing or signalled job stops every rank and says who failed.

Launch tests start the real command line (``python -m zerospeed.launcher.cli``), which runs torchrun,
which starts ranks running ``scripts/launch_rank_probe.py`` (stdlib only). Five launches in all, 3-15 s
each (marked slow: fresh interpreters import torch). The other tests start no process, or only the
command line failing on bad input.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from zerospeed.launcher import cli, failures, launch, rank_entry

PROBE = Path(__file__).parent / "scripts" / "launch_rank_probe.py"
LAUNCH_TIMEOUT_S = 30.0

TORCHRUN_TABLE = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
fail.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-30_01:37:13
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 3867)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 3867
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_01:37:13
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 3 (pid: 3868)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def _cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "zerospeed.launcher.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _launch_probe(out_dir: Path, mode: str, *flags: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    result = _cli("launch", "--nproc-per-node", "2", *flags, str(PROBE), str(out_dir), mode)
    return result, time.monotonic() - start


def _rank_records(out_dir: Path) -> dict[int, dict]:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out_dir.glob("rank_*.json")}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_nothing_left(out_dir: Path, records: dict[int, dict]) -> None:
    """No rank pid alive, and no process (torchrun, a rank) whose command line names ``out_dir``."""
    deadline = time.monotonic() + 5.0  # the kernel may take a moment to reap
    while time.monotonic() < deadline and any(_alive(r["pid"]) for r in records.values()):
        time.sleep(0.1)
    assert [r["pid"] for r in records.values() if _alive(r["pid"])] == []
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if str(out_dir) in " ".join(proc.info["cmdline"] or []) and _alive(proc.info["pid"]):
            left.append(proc.info)
    assert left == []


# --- launches ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_get_torchrun_env_and_local_rank(tmp_path: Path) -> None:
    result, _ = _launch_probe(tmp_path, "ok", "--pass-local-rank")
    assert result.returncode == 0, result.stderr
    records = _rank_records(tmp_path)
    assert sorted(records) == [0, 1]
    for rank, record in records.items():
        env = record["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert record["argv"] == [f"--local_rank={rank}", str(tmp_path), "ok"]
    assert records[0]["env"]["MASTER_PORT"] == records[1]["env"]["MASTER_PORT"]


@pytest.mark.slow
def test_rank_exception_stops_all_and_names_rank_and_traceback(tmp_path: Path) -> None:
    result, elapsed = _launch_probe(tmp_path, "raise")
    assert result.returncode == 1, result.stderr
    assert elapsed < LAUNCH_TIMEOUT_S
    summary = result.stderr[result.stderr.rindex("zerospeed launch:"):]
    headline = summary.splitlines()[0]
    assert "rank 1 failed (exit code 1): ValueError: rank 1 fails on purpose" in headline
    assert "stopped: rank 0" in headline
    assert "fail_on_purpose" in summary  # the traceback's last lines
    records = _rank_records(tmp_path)
    assert sorted(records) == [0, 1]
    _assert_nothing_left(tmp_path, records)


@pytest.mark.slow
def test_rank_os_exit_stops_all_and_keeps_its_exit_code(tmp_path: Path) -> None:
    result, elapsed = _launch_probe(tmp_path, "exit3")
    assert result.returncode == 3, result.stderr
    assert elapsed < LAUNCH_TIMEOUT_S
    headline = result.stderr[result.stderr.rindex("zerospeed launch:"):].splitlines()[0]
    assert "rank 1 failed (exit code 3" in headline
    assert "stopped: rank 0" in headline
    _assert_nothing_left(tmp_path, _rank_records(tmp_path))


@pytest.mark.slow
def test_blame_goes_to_the_first_failure_not_to_its_echo_or_the_stopped(tmp_path: Path) -> None:
    # Rank 1 dies without a report (os._exit(3)); rank 0 raises at once because of it; rank 2, stopped by
    # torchrun, exits 143 from its SIGTERM handler. Rank 1 is to blame, and the exit code is its 3.
    start = time.monotonic()
    result = _cli("launch", "--nproc-per-node", "3", str(PROBE), str(tmp_path), "echo")
    assert time.monotonic() - start < 2 * LAUNCH_TIMEOUT_S
    assert result.returncode == 3, result.stderr
    headline = result.stderr[result.stderr.rindex("zerospeed launch:"):].splitlines()[0]
    assert headline.startswith("zerospeed launch: rank 1 failed (exit code 3"), headline
    stopped = headline.split("stopped: ")[-1] if "stopped: " in headline else ""
    assert "2" in stopped and "143" not in headline, headline
    _assert_nothing_left(tmp_path, _rank_records(tmp_path))


@pytest.mark.slow
def test_sigterm_to_launcher_stops_ranks(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "zerospeed.launcher.cli", "launch", "--nproc-per-node", "2",
           str(PROBE), str(tmp_path), "sleep"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while len(_rank_records(tmp_path)) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.1)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - start < LAUNCH_TIMEOUT_S
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "got SIGTERM" in stderr
    _assert_nothing_left(tmp_path, _rank_records(tmp_path))


# --- bad input: clear error, exit code 2, no rank started --------------------------------------------


def test_missing_script_is_a_usage_error(tmp_path: Path) -> None:
    result = _cli("launch", "--nproc-per-node", "2", str(tmp_path / "nope.py"), "--lr", "1")
    assert result.returncode == 2
    assert "training script" in result.stderr and "nope.py" in result.stderr and "not found" in result.stderr
    assert "torch" not in result.stderr  # rejected before torchrun starts


@pytest.mark.parametrize("flags, message", [
    (["--nproc-per-node", "0"], "--nproc-per-node must be at least 1, got 0"),
    (["--num_gpus", "-2"], "--nproc-per-node must be at least 1, got -2"),
    (["--nnodes", "2", "--node_rank", "2", "--master_addr", "h"], "--node-rank must be in 0..1"),
    (["--nnodes", "2"], "--nnodes 2 needs --master-addr"),
    (["--master-port", "70000"], "--master-port must be in 1..65535"),
])
def test_bad_flags_are_usage_errors(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["launch", *flags, str(PROBE)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerospeed launch: error: ") and message in err


def test_deepspeed_top_level_form_and_typo(capsys: pytest.CaptureFixture[str]) -> None:
    top_level = ["--num_gpus", "2", "train.py"]
    assert cli._with_command(top_level, ["launch"]) == ["launch", *top_level]
    assert cli._with_command(["train.py", "--x"], ["launch"]) == ["launch", "train.py", "--x"]
    assert cli.main(["--num_gpus", "0", str(PROBE)]) == 2
    assert "zerospeed launch: error: --nproc-per-node must be at least 1" in capsys.readouterr().err
    assert cli.main(["lanch", "x.py"]) == 2
    assert "unknown command 'lanch'. Did you mean 'launch'?" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    capsys.readouterr()
    assert cli.main(["--autotuning", "tune", "--num_gpus", "2", str(PROBE)]) == 2  # runs the autotuner:
    err = capsys.readouterr().err
    assert "name no config" in err  # which needs the script's --deepspeed_config
    assert cli.main(["--bind_core_list", "0-1", "--num_gpus", "2", str(PROBE)]) == 2  # core binding is built now
    assert "--bind_core_list needs --bind_cores_to_rank" in capsys.readouterr().err


# --- pure parts ---------------------------------------------------------------------------------------


def test_script_args_after_the_script_are_not_launcher_flags() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["launch", "--num_gpus", "3", "--master_port", "1234", str(PROBE),
                              "--nproc-per-node", "9", "--local_rank", "5"])
    plan = launch.plan_from_args(args)
    assert (plan.nproc_per_node, plan.master_port) == (3, 1234)
    assert plan.target_args == ["--nproc-per-node", "9", "--local_rank", "5"]
    argv = launch.torchrun_argv(plan, python="py")
    assert argv[:3] == ["py", "-m", "torch.distributed.run"]
    assert "--nproc-per-node=3" in argv and "--master-port=1234" in argv and "--max-restarts=0" in argv
    entry = argv.index(os.path.abspath(rank_entry.__file__))
    assert argv[entry + 1:] == [str(PROBE), "--nproc-per-node", "9", "--local_rank", "5"]
    env = launch.rank_env(plan, "/tmp/x", base={})
    assert env[rank_entry.LAUNCH_DIR_ENV] == "/tmp/x" and env[rank_entry.PASS_LOCAL_RANK_ENV] == "1"  # DeepSpeed's default


def test_default_nproc_counts_visible_cuda_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    for visible, count in [("0,1,2", 3), ("", 0), ("-1", 0), ("0,-1,2", 1), ("GPU-abc,GPU-def", 2)]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert launch.visible_cuda_devices() == count
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    args = cli.build_parser().parse_args(["launch", str(PROBE)])
    plan = launch.plan_from_args(args)
    assert plan.nproc_per_node == 1 and 0 < plan.master_port < 65536


def test_torchrun_table_and_reports_merge_into_one_summary() -> None:
    agent = failures.parse_torchrun_failures("noise\n" + TORCHRUN_TABLE)
    assert {r: (f.exitcode, f.root_cause) for r, f in agent.items()} == {0: (-15, False), 1: (3, True)}
    failing, stopped = failures.merge_failures({}, agent)
    assert [f.rank for f in failing] == [1] and stopped == [0]
    text = failures.summarize(failing, stopped, 1)
    assert text == ("zerospeed launch: rank 1 failed (exit code 3, no Python traceback: it ended via os._exit "
                    "or in native code); stopped: rank 0")
    assert failures.exit_code_for(failing, 1) == 3


def test_precise_report_times_order_failures() -> None:
    # Both ranks raised in the same second; torchrun (1 s resolution) called rank 0 the root cause.
    reports = {
        0: failures.RankFailure(0, 1, time=10.5, error="RuntimeError: peer closed", traceback=["RuntimeError: x"]),
        1: failures.RankFailure(1, 1, time=10.2, error="ValueError: bad",
                                traceback=['  File "t.py"', "ValueError: bad"]),
    }
    agent = {0: failures.RankFailure(0, 1, root_cause=True), 1: failures.RankFailure(1, 1)}
    failing, stopped = failures.merge_failures(reports, agent)
    assert [f.rank for f in failing] == [1, 0] and stopped == []
    text = failures.summarize(failing, stopped, 1)
    assert text.splitlines()[0] == ("zerospeed launch: rank 1 failed (exit code 1): ValueError: bad; also failed: "
                                    "rank 0 (exit code 1): RuntimeError: peer closed")
    assert text.splitlines()[-1] == "    ValueError: bad"
    killed = [failures.RankFailure(2, -9, root_cause=True)]
    assert "rank 2 failed (killed by signal SIGKILL)" in failures.summarize(killed, [], 1)
    assert failures.exit_code_for(killed, 1) == 137
    assert "no rank reported a failure" in failures.summarize([], [], 1)


def test_ranks_torchrun_closed_are_stopped_not_blamed(tmp_path: Path) -> None:
    log = ("W1130 14:27:18.405000 10558 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process "
           "4242 closing signal SIGTERM\n" + TORCHRUN_TABLE.replace("-15 (pid: 3867)  (SIGTERM)", "143 (pid: 4242)"))
    assert failures.parse_closing_signals(log) == {4242}
    for rank, pid in [(0, 4242), (1, 4243)]:
        (tmp_path / f"rank_{rank}.pid").write_text(json.dumps({"rank": rank, "pid": pid}))
    closed = failures.stopped_ranks(log, str(tmp_path))
    assert closed == {0}
    # Rank 0's SIGTERM handler raised SystemExit(143) and wrote a report; it is still only "stopped".
    reports = {0: failures.RankFailure(0, 143, time=10.9, error="SystemExit(143)")}
    failing, stopped = failures.merge_failures(reports, failures.parse_torchrun_failures(log), closed)
    assert [f.rank for f in failing] == [1] and stopped == [0]
    assert failures.exit_code_for(failing, 1) == 3
    # Both ended before torchrun stopped anyone (its error line, no closing line): the death without a
    # report comes before the Python error that came after it, whatever torchrun called the root cause.
    both = "E1130 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 4242) of binary: python\n"
    assert failures.stopped_ranks(both, str(tmp_path)) == set()
    agent = {0: failures.RankFailure(0, 1, root_cause=True), 1: failures.RankFailure(1, -9)}
    echo = {0: failures.RankFailure(0, 1, time=10.2, error="RuntimeError: connection closed by peer")}
    failing, stopped = failures.merge_failures(echo, agent, set())
    assert [f.rank for f in failing] == [1, 0] and stopped == []
    assert failures.exit_code_for(failing, 1) == 137
    assert failures.stopped_ranks("no torchrun log here", str(tmp_path)) is None


def test_a_script_argument_that_prefixes_a_launcher_flag_stays_the_scripts() -> None:
    args = cli.build_parser().parse_args(["launch", "--nproc-per-node", "2", "train.py", "--elastic", "--nproc", "3"])
    assert args.target == "train.py" and args.target_args == ["--elastic", "--nproc", "3"]
    assert not args.elastic_training
