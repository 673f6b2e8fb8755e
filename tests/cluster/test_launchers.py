"""``zerospeed launch --hostfile H --launcher ssh|pdsh|openmpi`` for real, 2 hosts x 2 ranks.

Each launcher's losses equal a 4-rank single-host run (rtol 1e-5). The ranks run on the hosts the
hostfile and ``--include`` / ``--exclude`` leave, talk Gloo over the hosts' addresses (not loopback),
and see the variables of ``.deepspeed_env`` and ``--export`` and the ``GLOO_*`` / ``PYTHON*`` ones of the
launching shell. Each test is one launch (15-35 s on this loaded 2-core machine: fresh interpreters).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.cluster.common import launch, launch_argv, losses, rank_info
from tests.cluster.conftest import STEPS
from zerospeed.testing.cluster import Cluster


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
