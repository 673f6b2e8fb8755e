"""One real 3-host test cluster, three parts in this order (one module, so one test worker runs them all):

**The launchers.** ``zerospeed launch --hostfile H --launcher ssh|pdsh|openmpi`` for real, 2 hosts x 2 ranks.

Each launcher's losses equal a 4-rank single-host run (rtol 1e-5). The ranks run on the hosts the
hostfile and ``--include`` / ``--exclude`` leave, talk Gloo over the hosts' addresses (not loopback),
and see the variables of ``.deepspeed_env`` and ``--export`` and the ``GLOO_*`` / ``PYTHON*`` ones of the
launching shell. Each test is one launch (15-35 s on this loaded 2-core machine: fresh interpreters).

**Faults on the wire** of a real 2-host job (``--launcher ssh``, 2 ranks per host, ``comms_timeout_s`` 5).

node1 fails while the job trains; the launcher on node0 must exit non-zero naming node1 within
``comms_timeout_s`` + 5 s, and no process of the job may remain on either host afterwards:

- node1's namespace killed (every process SIGKILLed, its link gone);
- node1's link set down;
- an iptables DROP on node1 (the link stays up, no RST ever comes);
- node1 never answers ssh (DROP on port 22 before the launch).

A slow link (netem delay 200 ms) and 10 % packet loss are not failures: the job finishes with the losses of
the 4-rank run. After each test node1 is brought back fresh. The link-down, delay and loss tests run with
``ZEROSPEED_CLUSTER_FULL=1`` (the suite's time budget; the DROP test covers a silent cut).

**Elastic training across hosts** (``--elastic_training --launcher ssh``): node1 killed, the job goes on
at 2 ranks from the universal checkpoint, node1 reset and joined back: 4 ranks, the losses of a fixed-size
run from that checkpoint (~40 s; it replaces tests/dist/test_multinode.py's single-host elastic test here).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.cluster.common import launch, launch_argv, losses, mn_train, rank_info, reference_losses
from tests.cluster.conftest import STEPS, full_only
from zerospeed.testing.cluster import Cluster, faults, free_port


def _check(cluster: Cluster, out: Path, reference: list[float], hosts: list[str]) -> list[dict]:
    got = losses(out)
    assert [g["world"] for g in got] == [4] * STEPS
    torch.testing.assert_close(torch.tensor([g["loss"] for g in got]), torch.tensor(reference), rtol=1e-5, atol=0)
    ranks = rank_info(out)
    assert [r["host"] for r in ranks] == [h for h in hosts for _ in range(2)]
    assert {r["MASTER_ADDR"] for r in ranks} == {hosts[0]}
    addr = {h.name: h.addr for h in cluster.hosts}
    for r in ranks:  # Gloo between hosts: each rank holds connections to the other host's address
        other = next(h for h in hosts if h != r["host"])
        assert addr[other] in " ".join(r["peers"]), (r, addr)
    return ranks


def test_ssh_exclude_env_file(cluster: Cluster, cluster_env: dict[str, str], tmp_path: Path,
                              reference: list[float]) -> None:
    hostfile = cluster.write_hostfile(tmp_path / "hostfile", slots=2)
    (tmp_path / ".deepspeed_env").write_text("# read by the launcher on node0\nCL_FROM_ENV_FILE=from file\n")
    env = {**cluster_env, "GLOO_SOCKET_IFNAME": "eth0"}
    out = tmp_path / "out"
    argv = launch_argv(hostfile, "ssh", out, STEPS, "--exclude", "node1", "--export", "CL_EXPORTED=a b'c")
    done = launch(cluster, argv, tmp_path, env)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = _check(cluster, out, reference, ["node0", "node2"])
    assert {r["CL_FROM_ENV_FILE"] for r in ranks} == {"from file"}
    assert {r["CL_EXPORTED"] for r in ranks} == {"a b'c"}
    assert {r["GLOO_SOCKET_IFNAME"] for r in ranks} == {"eth0"}


def test_pdsh_include(cluster: Cluster, cluster_env: dict[str, str], tmp_path: Path, reference: list[float]) -> None:
    hostfile = cluster.write_hostfile(tmp_path / "hostfile", slots=2)
    out = tmp_path / "out"
    done = launch(cluster, launch_argv(hostfile, "pdsh", out, STEPS, "--include", "node1@node2"), tmp_path, cluster_env)
    assert done.returncode == 0, done.stderr[-4000:]
    _check(cluster, out, reference, ["node1", "node2"])


def test_openmpi(cluster: Cluster, cluster_env: dict[str, str], tmp_path: Path, reference: list[float]) -> None:
    hostfile = cluster.write_hostfile(tmp_path / "hostfile", slots=2, hosts=[0, 1])
    out = tmp_path / "out"
    argv = launch_argv(hostfile, "openmpi", out, STEPS, "--launcher_args=--allow-run-as-root")
    done = launch(cluster, argv, tmp_path, cluster_env)
    assert done.returncode == 0, done.stderr[-4000:]
    _check(cluster, out, reference, ["node0", "node1"])


def test_slurm_srun_inside_sbatch(cluster: Cluster, cluster_env: dict[str, str], tmp_path: Path,
                                  reference: list[float]) -> None:
    """``sbatch -N 2`` runs a batch script on node0 whose ``zerospeed launch --launcher slurm`` fans out
    with ``srun`` inside the allocation (munge, slurmctld on node0, slurmd on every host)."""
    from zerospeed.testing.cluster import ClusterUnavailable

    try:
        slurm_env = cluster.start_slurm()
    except ClusterUnavailable as e:
        pytest.skip(f"no SLURM on the test cluster: {e}")
    hostfile = cluster.write_hostfile(tmp_path / "hostfile", slots=2)
    out = tmp_path / "out"
    argv = launch_argv(hostfile, "slurm", out, STEPS, "--exclude", "node1", "--export", "CL_EXPORTED=via srun")
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nexec " + " ".join(f"'{a}'" for a in argv) + "\n")
    script.chmod(0o755)
    env = {**cluster_env, **slurm_env}
    done = launch(cluster, ["sbatch", "--wait", "-N", "2", "-w", "node0,node2", "-o", str(tmp_path / "job.log"),
                            str(script)], tmp_path, env)
    log = (tmp_path / "job.log").read_text() if (tmp_path / "job.log").exists() else ""
    assert done.returncode == 0, done.stderr[-2000:] + log[-4000:]
    ranks = _check(cluster, out, reference, ["node0", "node2"])
    assert {r["CL_EXPORTED"] for r in ranks} == {"via srun"}


# --- faults on the wire (after the launchers: each resets node1) ---

TIMEOUT_S = 5.0
SETTLE_S = 20.0  # after the launcher exits: node1's cut-off ranks end by their own collective timeout


@pytest.fixture
def node1_reset(cluster: Cluster) -> Iterator[None]:
    _CLUSTER[:] = [cluster]
    yield
    cluster.reset_host(1)


_CLUSTER: list[Cluster] = []


def _running() -> dict[int, list[str]]:
    c = _CLUSTER[0]
    return {i: [_cmdline(p) for p in c.busy_pids(i)] for i in (0, 1) if c.hosts[i].holder is not None}


def _wait_training(out: Path, proc: subprocess.Popen[str], log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (out / "losses.jsonl").exists() and len((out / "losses.jsonl").read_text().splitlines()) >= 1:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the job ended before the fault: {log.read_text()[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"the job did not start training: {log.read_text()[-3000:]}; running: {_running()}")


def _assert_nothing_left(cluster: Cluster) -> None:
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        left = {i: cluster.busy_pids(i) for i in (0, 1) if cluster.hosts[i].holder is not None}
        if not any(left.values()):
            return
        time.sleep(0.25)
    named = {i: [_cmdline(p) for p in pids] for i, pids in left.items()}
    raise AssertionError(f"processes left on the hosts {SETTLE_S} s after the job: {named}")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"{pid}: " + f.read().replace(b"\0", b" ").decode("utf-8", "replace")[:200]
    except OSError:
        return f"{pid}: (gone)"


def _fault_run(cluster: Cluster, env: dict[str, str], tmp: Path, fault: Callable[[], None],
               launcher: str = "ssh") -> tuple[int, str, float]:
    hostfile = cluster.write_hostfile(tmp / "hostfile", slots=2, hosts=[0, 1])
    out = tmp / "out"
    argv = launch_argv(hostfile, launcher, out, 200, "--shutdown-timeout", "3",
                       script_args=("--timeout", str(TIMEOUT_S), "--sleep", "0.2"))
    with open(tmp / "launcher.log", "w") as log:  # a file, not a pipe: nothing blocks on a full pipe
        proc = cluster.popen(0, argv, cwd=str(tmp), env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_training(out, proc, tmp / "launcher.log")
        fault()
        start = time.monotonic()
        proc.wait(timeout=60)
        return proc.returncode, (tmp / "launcher.log").read_text(), time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_host_brought_back_is_that_host(cluster: Cluster, node1_reset: None) -> None:
    """After a fault node1 comes back fresh: an ssh session there has its name, its /etc/hosts, its
    namespaces (not the machine's, which resolve no cluster name)."""
    cluster.kill_host(1)
    cluster.reset_host(1)
    said = cluster.run(0, ["ssh", "node1", "hostname; getent hosts node0; readlink /proc/self/ns/mnt"]).stdout.split()
    holder = cluster.hosts[1].holder
    assert holder is not None
    assert said == ["node1", cluster.hosts[0].addr, "node0", os.readlink(f"/proc/{holder.pid}/ns/mnt")], said


@pytest.mark.parametrize("fault", ["kill_host", pytest.param("link_down", marks=full_only), "iptables_drop"])
def test_host_lost_is_named(cluster: Cluster, cluster_env: dict[str, str], tmp_path: Path, node1_reset: None,
                            fault: str) -> None:
    act = {"kill_host": lambda: cluster.kill_host(1), "link_down": lambda: faults.link_down(cluster.hosts[1]),
           "iptables_drop": lambda: faults.drop(cluster.hosts[1])}[fault]
    code, err, elapsed = _fault_run(cluster, cluster_env, tmp_path, act)
    assert code != 0
    assert "host node1 (node 1) failed" in err, err[-3000:]
    assert elapsed < TIMEOUT_S + 5, f"named after {elapsed:.1f} s"
    _assert_nothing_left(cluster)


@full_only
def test_pdsh_names_a_silently_cut_host(cluster: Cluster, cluster_env: dict[str, str], tmp_path: Path,
                                        node1_reset: None) -> None:
    """pdsh gives no per-host exit: node0's launcher names node1 from the node watch's missing heartbeats
    (measured 13.5 s here with comms_timeout_s 5: the ranks' timeout, torchrun's stop, then the summary)."""
    code, err, elapsed = _fault_run(cluster, cluster_env, tmp_path, lambda: faults.drop(cluster.hosts[1]), "pdsh")
    assert code != 0
    assert "node 1 (node1) unreachable: nothing heard" in err, err[-3000:]
    assert elapsed < TIMEOUT_S + 15, f"named after {elapsed:.1f} s"
    _assert_nothing_left(cluster)


def test_host_that_never_answers_ssh(cluster: Cluster, cluster_env: dict[str, str], tmp_path: Path,
                                     node1_reset: None) -> None:
    faults.block_ssh(cluster.hosts[1])
    hostfile = cluster.write_hostfile(tmp_path / "hostfile", slots=2, hosts=[0, 1])
    start = time.monotonic()
    done = launch(cluster, launch_argv(hostfile, "ssh", tmp_path / "out", 2), tmp_path, cluster_env, timeout=60)
    elapsed = time.monotonic() - start
    assert done.returncode == 255, done.stderr[-3000:]
    assert "host node1 (node 1) failed with exit code 255" in done.stderr, done.stderr[-3000:]
    assert elapsed < TIMEOUT_S + 5 + 5, f"named after {elapsed:.1f} s"  # + ssh's ConnectTimeout (5 s)
    _assert_nothing_left(cluster)


@full_only
@pytest.mark.parametrize("how", ["delay 200ms", "loss 10%"])
def test_slow_or_lossy_link_still_trains(cluster: Cluster, cluster_env: dict[str, str], tmp_path: Path,
                                         node1_reset: None, reference: list[float], how: str) -> None:
    if how.startswith("delay"):
        try:
            faults.netem(cluster.hosts[1], how)
        except faults.NetemUnavailable as e:
            pytest.skip(str(e))
    else:
        faults.loss(cluster.hosts[1], 10)
    hostfile = cluster.write_hostfile(tmp_path / "hostfile", slots=2, hosts=[0, 1])
    out = tmp_path / "out"
    argv = launch_argv(hostfile, "ssh", out, STEPS, script_args=("--timeout", "20"))
    done = launch(cluster, argv, tmp_path, cluster_env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.tensor([g["loss"] for g in losses(out)])
    torch.testing.assert_close(got, torch.tensor(reference), rtol=1e-5, atol=0)


# --- elastic training across hosts: a host lost and brought back ---

# torch drops a silent node from the rendezvous after keep_alive_interval x keep_alive_max_attempt (5 s x 3
# by default): 1 s x 3 here, so that the survivors regroup 12 s sooner
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


def _elastic_argv(hostfile: str, out: Path, ckpt: Path, port: int, *flags: str) -> list[str]:
    return launch_argv(hostfile, "ssh", out, 200, "--elastic_training", "--min_elastic_nodes", "1",
                       "--max_elastic_nodes", "2", "--rdzv_conf", RDZV_CONF, "--shutdown-timeout", "3",
                       *flags, port=port, script_args=("--ckpt", str(ckpt), "--elastic", "--timeout",
                                                       str(TIMEOUT_S), "--sleep", "0.3"))


@pytest.mark.parametrize("fault", ["kill_host", pytest.param("iptables_drop", marks=full_only)])
def test_elastic_host_lost_and_readded(cluster: Cluster, cluster_env: dict[str, str], tmp_path: Path,
                                       node1_reset: None, fault: str) -> None:
    """``--elastic_training --launcher ssh`` on node0 and node1 (2 ranks each): node1's namespace is killed
    (or silently cut off: an iptables DROP) mid-training; the launcher names it and goes on, torchrun restarts node0's ranks at world 2 from the
    latest universal checkpoint; node1 is brought back fresh and joins (``--include node1 --force_multi``
    with node0 as master): world 4 again. Both restarted phases' losses equal one fixed-size 2-rank run
    from the shrunk phase's checkpoint (the global batch stays 8: rtol 1e-5)."""
    hostfile = cluster.write_hostfile(tmp_path / "hostfile", slots=2, hosts=[0, 1])
    out, ckpt, port = tmp_path / "out", tmp_path / "ckpt", free_port()
    log = str(out / "losses.jsonl")
    with open(tmp_path / "launcher.log", "w") as f:
        job = cluster.popen(0, _elastic_argv(hostfile, out, ckpt, port), cwd=str(tmp_path), env=cluster_env,
                            stdout=f, stderr=subprocess.STDOUT, text=True)
    procs = [job]
    try:
        mn_train.wait_phase(log, 4, 1, job)
        lost = time.time()
        cluster.kill_host(1) if fault == "kill_host" else faults.drop(cluster.hosts[1])
        mn_train.wait_phase(log, 2, 1, job)  # the 2-rank group trains on while node1 comes back and joins
        cluster.reset_host(1)
        joined = time.time()
        with open(tmp_path / "joiner.log", "w") as f:
            procs.append(cluster.popen(0, _elastic_argv(hostfile, out, ckpt, port, "--include", "node1",
                                                        "--force_multi", "--master_addr", "node0"),
                                       cwd=str(tmp_path), env=cluster_env, stdout=f, stderr=subprocess.STDOUT,
                                       text=True))
        mn_train.wait_phase(log, 4, 1, job)
    finally:
        mn_train.stop(procs)
    said = (tmp_path / "launcher.log").read_text()
    assert "host node1 (node 1) left the elastic job" in said, said[-3000:]
    phases = mn_train.phases(log)
    assert [p[0]["world"] for p in phases] == [4, 2, 4], phases
    _, shrunk, grown = phases
    print(f"{fault}: world 2 trained {shrunk[0]['time'] - lost:.1f} s after the fault, world 4 "
          f"{grown[0]['time'] - joined:.1f} s after node1's launch")  # the figures in docs/multinode.md
    ranks = rank_info(out)  # the grown phase's ranks 2 and 3 run on node1 again
    assert [r["host"] for r in ranks] == ["node0", "node0", "node1", "node1"], ranks
    assert all(r["step"] is not None and r["step"] >= grown[0]["step"] for r in ranks), ranks
    start, end = shrunk[0]["start"], grown[-1]["step"] + 1
    ref = reference_losses(tmp_path / "ref", end, world=2, ckpt=str(ckpt), load_tag=f"step{start}", save=False,
                           config=mn_train.ELASTIC_CONFIG)
    got = {e["step"]: e["loss"] for e in [*shrunk, *grown]}
    ref_at = dict(zip(range(start, end), ref))
    torch.testing.assert_close(torch.tensor(list(got.values())), torch.tensor([ref_at[s] for s in got]),
                               rtol=1e-5, atol=0)
    _assert_nothing_left(cluster)
