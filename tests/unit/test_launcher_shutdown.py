"""Tier 0: what the real-cluster tests found in the launcher, and the hung-rank blame (no cluster needed)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from zerospeed.launcher import failures, fanout, multinode, shutdown
from zerospeed.testing.cluster.netns import Network


def test_pdsh_connects_with_ssh_unless_told_otherwise() -> None:
    # Debian's pdsh defaults to rsh: without PDSH_RCMD_TYPE=ssh no node launcher ever starts.
    assert fanout.backend_env("pdsh", {})["PDSH_RCMD_TYPE"] == "ssh"
    assert fanout.backend_env("pdsh", {"PDSH_RCMD_TYPE": "exec"})["PDSH_RCMD_TYPE"] == "exec"
    assert "PDSH_RCMD_TYPE" not in fanout.backend_env("ssh", {})


def test_gloo_variables_reach_every_node(tmp_path: Path) -> None:
    env = {"GLOO_SOCKET_IFNAME": "eth0", "HOME_ONLY": "x"}
    got = multinode.collect_exports(env, str(tmp_path), str(tmp_path))
    assert got["GLOO_SOCKET_IFNAME"] == "eth0" and "HOME_ONLY" not in got


def _failure(rank: int, error: str) -> failures.RankFailure:
    return failures.RankFailure(rank, exitcode=1, time=1.0, error=error)


def test_hung_rank_goes_first_after_a_timeout() -> None:
    first = _failure(0, "rank 0: collective 'all_reduce' failed: Timed out waiting 5000ms")
    failing, stopped = failures.blame_hung([first], [1], [(1, "stopped")], 3)
    assert [f.rank for f in failing] == [1, 0] and stopped == []
    assert "never joined" in failing[0].describe() and "3 s" in failing[0].describe()
    summary = failures.summarize(failing, stopped, 1)
    assert summary.startswith("zerospeed launch: rank 1 failed")


def test_hung_rank_is_not_blamed_for_a_crash() -> None:
    failing, stopped = failures.blame_hung([_failure(0, "ValueError: bad batch")], [], [(1, "sleeping")], 3)
    assert [f.rank for f in failing] == [0] and stopped == [1]
    assert failures.blame_hung([_failure(0, "x")], [1], [], 3) == ([_failure(0, "x")], [1])


def test_shutdown_deadline_kills_a_stopped_rank(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        (tmp_path / "rank_1.pid").write_text(json.dumps({"pid": proc.pid, "rank": 1, "start": time.time()}))
        proc.send_signal(signal.SIGSTOP)
        deadline = shutdown.ShutdownDeadline(str(tmp_path), timeout_s=0.2)
        deadline.poll("no failure yet")
        assert deadline.started is None
        deadline.poll("Sending process 123 closing signal SIGTERM")
        assert deadline.started is not None and proc.poll() is None
        time.sleep(0.25)
        deadline.poll("")
        assert proc.wait(timeout=5) == -signal.SIGKILL
        assert [(h.rank, h.state) for h in deadline.hung] == [(1, "stopped")]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cluster_hosts_file_and_names() -> None:
    net = Network(3, ["node0", "node1", "node2"], "/tmp")
    assert net.hosts_file().splitlines()[1:] == ["10.231.0.10 node0", "10.231.0.11 node1", "10.231.0.12 node2"]
    assert all(h.netns.startswith("zscl-") for h in net.hosts)


def test_shutdown_deadline_spares_a_restarted_group(tmp_path: Path) -> None:
    # --max_restarts: torchrun restarts the group after a failure; the new ranks (new pids) are not killed.
    old = subprocess.Popen([sys.executable, "-c", "pass"])
    new = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        (tmp_path / "rank_0.pid").write_text(json.dumps({"pid": old.pid, "rank": 0, "start": time.time()}))
        deadline = shutdown.ShutdownDeadline(str(tmp_path), timeout_s=0.1)
        deadline.poll("Sending process 1 closing signal SIGTERM")
        old.wait(timeout=10)
        (tmp_path / "rank_0.pid").write_text(json.dumps({"pid": new.pid, "rank": 0, "start": time.time()}))
        time.sleep(0.15)
        deadline.poll("")
        assert new.poll() is None and deadline.hung == []
    finally:
        new.kill()
        new.wait()


def test_node_watch_heartbeats_and_names_a_silent_peer() -> None:
    from zerospeed.launcher import nodewatch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1] % 20000 + 20000
    node0 = nodewatch.NodeWatch(0, 2, "127.0.0.1", port, "h0", lambda n, t: None, join_timeout=10)
    node1 = nodewatch.NodeWatch(1, 2, "127.0.0.1", port, "h1", lambda n, t: None, join_timeout=10)
    node0.start()
    node1.start()
    try:
        time.sleep(nodewatch.HEARTBEAT_S * 2.5)
        assert node0.silent(nodewatch.HEARTBEAT_S * 1.5) == [] and node1.silent(nodewatch.HEARTBEAT_S * 1.5) == []
        node0._heard[1] -= 10  # a link cut silently: nothing heard from node 1 for 10 s
        node0.blame_silent()
        assert node0.event is not None and node0.event.startswith("node 1 (h1) unreachable: nothing heard")
    finally:
        node1.finish(0)
        node0.finish(0)
