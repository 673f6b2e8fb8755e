"""Multi-node launch, pure parts: hostfile and --include/--exclude against DeepSpeed 0.19.8's own answers
(``fixtures/ds_hostfile_cases.json``, made by ``make_ds_hostfile_cases.py``), the per-launcher command
lines, ``.deepspeed_env`` / ``--export``, SLURM's variables, the node watch protocol and ranks per node."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import time
from pathlib import Path

import pytest

from zerospeed.comm import hierarchy
from zerospeed.launcher import cli, fanout, hostfile, launch, multinode, multinode_flags, nodewatch

CASES = json.loads((Path(__file__).parent / "fixtures" / "ds_hostfile_cases.json").read_text())
SCRIPT = str(Path(__file__))


@pytest.mark.parametrize("name", sorted(CASES["hostfiles"]))
def test_hostfile_parsing_matches_deepspeed(name: str) -> None:
    expected = CASES["hostfiles"][name]
    lines = CASES["hostfile_text"][name]
    if "ok" in expected:
        assert hostfile.parse_hostfile(lines) == expected["ok"]
        assert list(hostfile.parse_hostfile(lines)) == list(expected["ok"])  # order decides node ranks
    else:
        with pytest.raises(hostfile.HostfileError) as err:
            hostfile.parse_hostfile(lines, source="hf")
        if name != "empty":  # ours names the line
            assert str(err.value).startswith("hf:3:" if name == "dup" else "hf:2:")


@pytest.mark.parametrize("include, exclude, expected", CASES["filters"])
def test_include_exclude_match_deepspeed(include: str, exclude: str, expected: dict) -> None:
    if "ok" in expected:
        got = hostfile.active_resources(CASES["pool"], include, exclude)
        assert got == expected["ok"] and list(got) == list(expected["ok"])
    else:
        with pytest.raises(hostfile.HostfileError) as err:
            hostfile.active_resources(CASES["pool"], include, exclude)
        if "mutually" not in expected["error"]:
            assert str(err.value) == expected["error"]


@pytest.mark.parametrize("num_nodes, num_gpus, expected", CASES["nums"])
def test_num_nodes_and_gpus_match_deepspeed(num_nodes: int, num_gpus: int, expected: dict) -> None:
    assert hostfile.active_resources(CASES["pool"], num_nodes=num_nodes, num_gpus=num_gpus) == expected["ok"]
    with pytest.raises(hostfile.HostfileError, match="Cannot specify"):
        hostfile.active_resources(CASES["pool"], include="worker-0", num_gpus=1)


def _args(*flags: str):
    return cli.build_parser().parse_args(["launch", *flags, SCRIPT, "--lr", "1"])


def test_node_commands_per_launcher(tmp_path: Path) -> None:
    res = {"a": [0, 1], "b": [2, 3]}
    nargs = multinode.NodeArgs(target="/t.py", target_args=["--x", "a b"], resources=res, master_addr="a",
                               master_port=1234, python="py")
    ssh = multinode.ssh_commands(nargs, {"K": "v w"}, "/w", ssh_port=22)
    assert [h for h, _ in ssh] == ["a", "b"]
    host_b = ssh[1][1]
    assert host_b[:5] == ["ssh", "-p", "22", "-tt", "b"]
    remote = shlex.split(host_b[5])
    assert remote[:5] == ["cd", "/w", "&&", "export", "K=v w;"] and "--node_rank=1" in remote
    assert remote[-3:] == ["/t.py", "--x", "a b"] and "--nnodes=2" in remote and "--master_addr=a" in remote
    wi = next(a for a in remote if a.startswith("--world_info="))
    assert multinode.decode_world_info(wi.split("=", 1)[1]) == res
    pdsh = multinode.pdsh_command(nargs, {}, "/w")
    assert pdsh[:6] == ["pdsh", "-S", "-f", "1024", "-w", "a,b"] and "--node_rank=%n" in pdsh[6]
    srun = multinode.slurm_command(nargs, {"K": "v"}, nodelist=True)
    assert srun[:8] == ["srun", "-n", "2", "--ntasks-per-node=1", "--nodelist", "a,b", "--nodes", "2"]
    assert "--export=ALL,K=v" in srun and "--node_rank=env:SLURM_NODEID" in srun
    with pytest.raises(ValueError, match="same slot count"):
        multinode.slurm_command(multinode.NodeArgs(target="t", resources={"a": [0], "b": [0, 1]}), {})
    mpi = multinode.openmpi_command(nargs, {"K": "v"}, "/hf")
    assert mpi[:7] == ["mpirun", "-n", "2", "--map-by", "ppr:1:node", "-hostfile", "/hf"]
    assert "btl_tcp_if_include" in mpi and "UCX_TLS=tcp" in mpi and "K=v" in mpi
    assert "--node_rank=env:OMPI_COMM_WORLD_RANK" in mpi
    mpi2 = multinode.openmpi_command(nargs, {}, "/hf", launcher_args="--mca btl_tcp_if_include ib0")
    assert mpi2.count("btl_tcp_if_include") == 1
    elastic = multinode.node_launch_argv(multinode.NodeArgs(target="t", resources=res, elastic=(1, 2),
                                                            rdzv_conf="last_call_timeout=1"), "0")
    assert "--elastic_training" in elastic and "--min_elastic_nodes=1" in elastic
    assert "--rdzv_conf=last_call_timeout=1" in elastic  # every node's rendezvous gets it


@pytest.mark.parametrize("elastic", [False, True])
def test_a_failed_host_stops_the_job_unless_elastic(elastic: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """Fixed size: the first host that fails is named and the others are stopped. Elastic: the failed host
    has left, the others go on (torchrun regroups them) and the job ends with their result."""
    procs = [("a", subprocess.Popen(["sh", "-c", "exit 255"])),
             ("b", subprocess.Popen(["sh", "-c", "sleep 1.5; exit 0"]))]
    code = fanout._wait_all(procs, [], grace_s=5.0, elastic=elastic)
    said = capsys.readouterr().err
    if elastic:
        assert code == 0 and procs[1][1].returncode == 0
        assert "host a (node 0) left the elastic job (exit code 255); 1 host(s) go on" in said
    else:
        assert code == 255 and procs[1][1].returncode == -15  # SIGTERM
        assert "host a (node 0) failed with exit code 255; stopping the other nodes" in said


def test_env_files_and_exports(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=x=y\n")
    (cwd / ".deepspeed_env").write_text("# comment\n\nA=cwd\n")
    env = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/p", "HOME": "/h", "OTHER": "no"}
    out = multinode.collect_exports(env, str(cwd), str(home), ["C=1", "A=flag"])
    assert out == {"NCCL_DEBUG": "INFO", "PYTHONPATH": f"{cwd}:/p", "A": "flag", "B": "x=y", "C": "1"}
    (cwd / "mine").write_text("K=1\n")
    assert multinode.collect_exports({"DS_ENV_FILE": "mine"}, str(cwd), str(home))["K"] == "1"
    with pytest.raises(ValueError, match="KEY=VALUE"):
        multinode.collect_exports({}, str(cwd), str(home), ["1BAD=x"])
    (cwd / ".deepspeed_env").write_text("novalue\n")
    with pytest.raises(ValueError, match=r"\.deepspeed_env:1"):
        multinode.collect_exports({}, str(cwd), str(home))


def test_slurm_variables() -> None:
    assert multinode.expand_first_host("node[03-05,9],gpu1") == "node03"
    assert multinode.expand_first_host("gpu1,gpu2") == "gpu1"
    env = {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "n[7-10]", "SLURM_STEP_ID": "0"}
    assert multinode.slurm_node(env) == (4, 2, "n7")
    plan = launch.plan_from_args(_args("--launcher", "slurm", "--nproc_per_node", "2"), env)
    assert (plan.nnodes, plan.node_rank, plan.master_addr, plan.nproc_per_node) == (4, 2, "n7", 2)
    with pytest.raises(ValueError, match="SLURM_NODEID"):
        multinode.slurm_node({"SLURM_NNODES": "2"})


def test_plans_from_hostfile_world_info_and_elastic(tmp_path: Path) -> None:
    hf = tmp_path / "hosts"
    hf.write_text("# two nodes\nalpha slots=4\nbeta slots=4\n")
    args = _args("--hostfile", str(hf), "--launcher", "ssh", "--include", "alpha:1,3@beta")
    assert multinode_flags.fan_out_resources(args, {}) == {"alpha": [1, 3], "beta": [0, 1, 2, 3]}
    one = _args("--hostfile", str(hf), "--include", "beta:2,3")
    assert multinode_flags.fan_out_resources(one, {}) is None  # one host left: run here
    plan = launch.plan_from_args(one, {})
    assert (plan.nproc_per_node, plan.visible_devices, plan.nnodes) == (2, "2,3", 1)
    assert launch.rank_env(plan, "/d", base={})["CUDA_VISIBLE_DEVICES"] == "2,3"
    wi = multinode.encode_world_info({"alpha": [1, 3], "beta": [0, 1, 2]})
    node = launch.plan_from_args(_args(f"--world_info={wi}", "--node_rank=env:R", "--master_addr", "alpha"),
                                 {"R": "1"})
    assert (node.nnodes, node.node_rank, node.nproc_per_node, node.visible_devices, node.host) == (
        2, 1, 3, "0,1,2", "beta")
    nossh = launch.plan_from_args(_args("--hostfile", str(hf), "--no_ssh", "--node_rank", "1"), {})
    assert (nossh.nnodes, nossh.node_rank, nossh.master_addr) == (2, 1, "alpha")
    el = launch.plan_from_args(_args("--elastic_training", "--min_elastic_nodes", "1", "--max_elastic_nodes",
                                     "2", "--master_addr", "127.0.0.1", "--master_port", "29600"), {})
    argv = launch.torchrun_argv(el, python="py")
    assert "--nnodes=1:2" in argv and "--rdzv-backend=c10d" in argv and "--rdzv-endpoint=127.0.0.1:29600" in argv
    assert "--max-restarts=3" in argv and not any(a.startswith("--node-rank") for a in argv)
    for flags, message in [
        (["--hostfile", str(hf), "--include", "gamma"], "Hostname 'gamma' not found in hostfile"),
        (["--hostfile", str(hf), "--include", "alpha", "--exclude", "beta"], "mutually exclusive"),
        (["--elastic_training", "--min_elastic_nodes", "3", "--max_elastic_nodes", "2"], "must not exceed"),
        (["--world_info", wi, "--node_rank", "env:NOPE"], "NOPE is not set"),
    ]:
        with pytest.raises(ValueError, match=message):
            launch.plan_from_args(_args(*flags), {})
    hf.write_text("alpha slots=4\nalpha slots=2\n")
    with pytest.raises(ValueError, match=f"{hf}:2: host 'alpha' is listed twice"):
        launch.plan_from_args(_args("--hostfile", str(hf)), {})


def test_node_watch_reports() -> None:
    assert nodewatch.describe(["exit 0 "], False, "node 1") is None
    assert nodewatch.describe(["exit 3 rank 2 failed"], False, "node 1") == "node 1 failed (exit code 3): rank 2 failed"
    assert "node 1 lost" in nodewatch.describe([], True, "node 1")


def test_ranks_per_node_come_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = launch.plan_from_args(_args("--nproc_per_node", "3"), {})
    assert launch.rank_env(plan, "/d", base={})[hierarchy.RANKS_PER_NODE_ENV] == "3"
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv(hierarchy.RANKS_PER_NODE_ENV, "3")
    layout = hierarchy.NodeLayout(6, hierarchy.ranks_per_node_from_env(default=6))
    assert layout.nodes == 2 and layout.intra_ranks(1) == [3, 4, 5]  # real node boundaries, not one node
    monkeypatch.delenv(hierarchy.RANKS_PER_NODE_ENV)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "5")
    assert hierarchy.ranks_per_node_from_env() == 5


def _free_pair() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s2:
                s2.bind(("", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def _wait(events: list, n: int = 1, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while len(events) < n and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.mark.parametrize("how", ["failed", "lost", "early", "clean"])
def test_node_watch_names_the_peer(how: str) -> None:
    port = _free_pair()
    seen0: list = []
    seen1: list = []
    node0 = nodewatch.NodeWatch(0, 2, "127.0.0.1", port, "h0", lambda n, t: seen0.append((n, t)), join_timeout=10)
    node0.start()
    node1 = nodewatch.NodeWatch(1, 2, "127.0.0.1", port, "h1", lambda n, t: seen1.append((n, t)), join_timeout=10)
    try:
        if how == "early":
            nodewatch.report_early_failure("127.0.0.1", port, 1, "h1", 2, "training script 'x.py' not found")
            _wait(seen0)
            assert seen0 == [(1, "node 1 (h1) failed (exit code 2): training script 'x.py' not found")]
            return
        node1.start()
        for _ in range(500):
            if node0._peers and node1._peers:
                break
            time.sleep(0.02)
        if how == "failed":
            node1.finish(3, "rank 2 failed (exit code 3)")
            _wait(seen0)
            assert seen0 == [(1, "node 1 (h1) failed (exit code 3): rank 2 failed (exit code 3)")]
        elif how == "lost":
            node1._peers[0].shutdown(socket.SHUT_RDWR)  # the launcher died: closed without an exit line
            _wait(seen0)
            assert seen0[0][0] == 1 and "node 1 (h1) lost" in seen0[0][1]
        else:
            node0.finish(0)
            node1.finish(0)
            _wait(seen1, timeout=1.0)
            assert seen0 == [] and seen1 == []
    finally:
        node0.finish(1)
        node1.finish(1)


def test_node_watch_names_a_node_that_never_joins() -> None:
    seen: list = []
    node0 = nodewatch.NodeWatch(0, 3, "127.0.0.1", _free_pair(), "h0", lambda n, t: seen.append((n, t)),
                                join_timeout=0.5)
    node0.start()
    _wait(seen)
    node0.finish(1)
    assert seen and seen[0][0] == 1 and "node(s) 1, 2 did not join within" in seen[0][1]
