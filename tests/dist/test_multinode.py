"""Two simulated nodes on this machine: ``zerospeed launch`` per "node" sharing a rendezvous on 127.0.0.1.

- a hostfile of two hosts with ``--launcher ssh|pdsh|slurm|openmpi`` (fake ``ssh``, ``pdsh``, ``srun`` and
  ``mpirun`` on PATH run each node's command here, scripts/fake_cluster.py; only where tests/cluster cannot
  run the real programs on namespaced hosts) starts two node launchers (``--nnodes 2 --node_rank 0/1``, 2 ranks each): the tiny GPT's losses equal a
  4-rank single-node run; every rank sees 2 ranks per node and the ``--export``-ed variable;
- killing one node's launcher makes the other exit with an error naming that node, within a bound, and
  leaves no rank alive;
- a node whose launch fails (bad script path) or whose rank exits 1 is named by the other node;
- ``--elastic_training`` (42-106 s; ``ZEROSPEED_ELASTIC_E2E=0`` skips it; so does a machine where
  tests/cluster runs it across real hosts): one of two nodes killed, torchrun restarts the other at 2 ranks
  from the latest checkpoint; a node joining again brings it back to 4.

Subprocess tests (each 10-40 s on a loaded machine: fresh interpreters import torch), marked slow.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from zerospeed.testing import run_distributed

SCRIPTS = Path(__file__).parent / "scripts"
TRAIN = SCRIPTS / "mn_train.py"
sys.path.insert(0, str(SCRIPTS))
import mn_train  # noqa: E402 - the launched script: its losses.jsonl readers, and its loop for the forked references

sys.path.remove(str(SCRIPTS))
pytestmark = pytest.mark.slow


def ports() -> int:
    """A port P with P and P+1 (the node watch) free now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p < 65535:
            try:
                with socket.socket() as s2:
                    s2.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise RuntimeError("no two adjacent free ports")


def _env(extra_path: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if extra_path is not None:
        env["PATH"] = f"{extra_path}:{env['PATH']}"
    return env


def _node(rank: int, port: int, *script_args: str, script: Path = TRAIN, timeout: float = 20) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "zerospeed.launcher.cli", "launch", "--nnodes", "2", "--node_rank", str(rank),
           "--nproc-per-node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
           "--node_join_timeout", str(timeout), "--shutdown-timeout", "3", str(script), *script_args]
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _reference(out: str, steps: int) -> list[float]:
    return mn_train.train(out, steps)  # the script's own loop, run by the forked harness


def _fake_launchers(tmp_path: Path) -> Path:
    """A bin directory with a fake ``ssh`` (runs the remote command, its last argument, here) and fake
    ``pdsh`` / ``srun`` / ``mpirun`` (scripts/fake_cluster.py: one task per node, here)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ssh").write_text('#!/bin/bash\n# fake ssh: run the remote command (the last argument) here\n'
                              'exec bash -c "${@: -1}"\n')
    (fake / "ssh").chmod(0o755)
    cluster = (SCRIPTS / "fake_cluster.py").read_text()
    for program in ("pdsh", "srun", "mpirun"):
        (fake / program).write_text(f"#!{sys.executable}\n{cluster}")
        (fake / program).chmod(0o755)
    return fake


def _real_cluster_here(launcher: str) -> bool:
    """tests/cluster runs this launcher's real program on a cluster of network namespaces here."""
    from zerospeed.testing.cluster import packages, unavailable_reason

    programs = {"ssh": ("sshd",), "pdsh": ("pdsh",), "slurm": ("slurmd", "slurmctld", "munged", "sbatch"),
                "openmpi": ("mpirun",)}[launcher]
    return unavailable_reason((*packages.BASE_PROGRAMS, *programs), install=False) is None


@pytest.mark.parametrize("launcher", ["ssh", "pdsh", "slurm", "openmpi"])
def test_two_nodes_match_one_node(tmp_path: Path, launcher: str) -> None:
    """The stand-in programs (scripts/fake_cluster.py), kept for machines where tests/cluster cannot make
    its cluster (not root, no network namespaces): there the real ``launcher`` runs instead."""
    if _real_cluster_here(launcher):
        pytest.skip(f"tests/cluster runs the real {launcher} on namespaced hosts here")
    fake = _fake_launchers(tmp_path)
    hosts = tmp_path / "hostfile"
    hosts.write_text("# two simulated nodes\nnode-a slots=2\nnode-b slots=2\n")
    out = tmp_path / "two_nodes"
    cmd = [sys.executable, "-m", "zerospeed.launcher.cli", "--hostfile", str(hosts), "--launcher", launcher,
           "--master_addr", "127.0.0.1", "--master_port", str(ports()), "--export", "MN_EXPORTED=yes",
           str(TRAIN), str(out), "3"]
    result = subprocess.run(cmd, env=_env(fake), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    got = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    assert [g["world"] for g in got] == [4, 4, 4]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["ZEROSPEED_RANKS_PER_NODE"] for r in ranks] == ["2"] * 4
    assert [r["GROUP_RANK"] for r in ranks] == ["0", "0", "1", "1"]  # node-major ranks: real node boundaries
    assert {r["MN_EXPORTED"] for r in ranks} == {"yes"} and {r["CUDA_VISIBLE_DEVICES"] for r in ranks} == {"0,1"}
    ref = run_distributed(_reference, 4, str(tmp_path / "ref"), 3, timeout=120)[0]
    torch.testing.assert_close(torch.tensor([g["loss"] for g in got]), torch.tensor(ref), rtol=1e-5, atol=0)


def _wait_for(path: Path, lines: int, procs: list[subprocess.Popen[str]], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= lines:
            return
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a node ended early: {p.communicate()[1][-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {lines} lines in {path} after {timeout} s")


@pytest.mark.parametrize("killed", [1, 0])
def test_killing_a_node_names_it_and_leaves_no_rank(tmp_path: Path, killed: int) -> None:
    port = ports()
    nodes = [_node(r, port, str(tmp_path), "50", "--sleep", "0.5") for r in range(2)]
    try:
        _wait_for(tmp_path / "losses.jsonl", 1, nodes)
        pids = [json.loads((tmp_path / f"rank{r}.json").read_text())["pid"] for r in range(4)]
        nodes[killed].send_signal(signal.SIGKILL)
        start = time.monotonic()
        _, err = nodes[1 - killed].communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert nodes[1 - killed].returncode != 0
    assert f"node {killed}" in err and "lost" in err, err[-3000:]
    assert elapsed < 45
    gone = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=20)[1]
    assert not [p for p in gone if p.status() != psutil.STATUS_ZOMBIE], "ranks left running"


@pytest.mark.parametrize("how", ["bad_script", "rank_exit_1"])
def test_a_failing_node_is_named(tmp_path: Path, how: str) -> None:
    port = ports()
    node0 = _node(0, port, str(tmp_path), "5", "--sleep", "0.5")
    if how == "bad_script":
        node1 = _node(1, port, str(tmp_path), "5", script=tmp_path / "missing.py")
        expect = ["node 1", "failed (exit code 2)", "missing.py", "not found"]
    else:
        node1 = _node(1, port, str(tmp_path), "5", "--sleep", "0.5", "--fail_rank", "2")
        expect = ["node 1", "failed (exit code 1)", "rank 2"]
    try:
        _, err0 = node0.communicate(timeout=90)
        node1.communicate(timeout=60)
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
    assert node0.returncode != 0 and node1.returncode != 0
    for text in expect:
        assert text in err0, err0[-3000:]


def _elastic_node(port: int, out: Path, ckpt: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "zerospeed.launcher.cli", "launch", "--elastic_training", "--min_elastic_nodes",
           "1", "--max_elastic_nodes", "2", "--max_restarts", "3", "--rdzv_conf", "last_call_timeout=1",
           "--nproc-per-node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port), str(TRAIN),
           str(out), "200", "--ckpt", str(ckpt), "--sleep", "0.5", "--elastic"]
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.skipif(os.environ.get("ZEROSPEED_ELASTIC_E2E") == "0",
                    reason="ZEROSPEED_ELASTIC_E2E=0 skips it (42-106 s on 2 shared cores: three starts of fresh "
                    "interpreters); test_elastic_restart.py covers the resharded resume in-process.")
def test_elastic_launch_shrinks_and_grows(tmp_path: Path) -> None:
    """--elastic_training with the `elasticity` section's batch rules: kill one of two nodes, torchrun restarts
    the other at 2 ranks from the latest checkpoint; a node joining again restarts both at 4 ranks. Losses after
    each restart equal a 2-rank run from the same checkpoint (rtol 1e-5). Where tests/cluster can run, its
    test_elastic_host_lost_and_readded does this with a real host lost (no RST) and re-added instead."""
    if _real_cluster_here("ssh"):
        pytest.skip("tests/cluster runs elastic training across namespaced hosts here (a real host lost)")
    port, out, ckpt = ports(), tmp_path / "out", tmp_path / "ckpt"
    log = str(out / "losses.jsonl")
    first = _elastic_node(port, out, ckpt)
    time.sleep(2.0)  # the first node hosts the c10d store
    second = _elastic_node(port, out, ckpt)
    procs = [first, second]
    try:
        mn_train.wait_phase(log, 4, 2, first)
        second.send_signal(signal.SIGKILL)
        second.wait()
        mn_train.wait_phase(log, 2, 2, first)
        third = _elastic_node(port, out, ckpt)
        procs.append(third)
        mn_train.wait_phase(log, 4, 1, first)
    finally:
        mn_train.stop(procs)
    phases = mn_train.phases(log)
    worlds = [p[0]["world"] for p in phases]
    assert worlds[:1] == [4] and 2 in worlds and worlds[-1] == 4, worlds
    shrunk = next(p for p in phases if p[0]["world"] == 2)
    grown = phases[-1]
    for phase in (shrunk, grown):
        start = phase[0]["start"]
        ref = run_distributed(_ref_from, 2, str(tmp_path / f"ref{start}"), start + len(phase), str(ckpt),
                              f"step{start}", timeout=120)[0]
        torch.testing.assert_close(torch.tensor([e["loss"] for e in phase]), torch.tensor(ref), rtol=1e-5, atol=0)


def _ref_from(out: str, steps: int, ckpt: str, tag: str) -> list[float]:
    return mn_train.train(out, steps, ckpt, load_tag=tag, save=False, config=mn_train.ELASTIC_CONFIG)
