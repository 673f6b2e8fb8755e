"""ZeRO-3 against ZeRO++ (hpZ, qgZ, qwZ) and MiCS's hierarchical gather on real sockets between 2 hosts.

    sudo .venv/bin/python benchmarks/bench_cluster_links.py --steps 4 [--rate 1gbit] [--delay 1ms] [--only ...]

A test cluster (``zerospeed.testing.cluster``: 2 hosts as network namespaces on a bridge, sshd on each;
root needed) runs every contender as a real 2 hosts x 2 ranks job, ``zerospeed launch --launcher ssh``,
ranks talking Gloo over the hosts' veth link. ``tc`` shapes each host's eth0 (what it sends) to ``--rate``
(``--rate none``: unshaped), plus ``--delay`` where the kernel has netem; inside a host the ranks talk
over its loopback, unshaped. Each contender trains ``GPT(bench)`` (10.8M parameters) at stage 3, fp32,
Adam, micro-batch 1 x 64 tokens per rank (small: the step is communication-bound, as a large model's
is), every parameter partitioned and none kept gathered (persistence threshold 0, reuse distance 0).

Per step, after one warm-up step: rank 0's wall seconds; the message bytes the comms logger counted on
rank 0 for groups spanning both hosts (*inter*) or one (*intra*, bench_zeropp.py's split); and the bytes
that crossed the wire, both hosts' eth0 sent bytes added (``/proc/net/dev`` in each host's namespace:
all 4 ranks, TCP headers and retransmissions included). A benchmark prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RANKS_PER_NODE = 2
TOKENS = 64
SRC = str(Path(__file__).resolve().parents[1] / "src")


def contenders() -> dict[str, dict[str, Any]]:
    hpz = {"zero_hpz_partition_size": RANKS_PER_NODE}
    qgz = {"zero_quantized_gradients": True}
    qwz = {"zero_quantized_weights": True}
    return {"ZeRO-3": {}, "hpZ": hpz, "qgZ": qgz, "qwZ+hpZ+qgZ": {**qwz, **hpz, **qgz},
            "MiCS hier. gather (shard 4)": {"mics_shard_size": 4, "mics_hierarchical_params_gather": True},
            "MiCS (shard 2 = one host)": {"mics_shard_size": 2}}


def _sent_bytes() -> int:
    """What this host sent on eth0 (``/proc/net/dev`` is per network namespace)."""
    with open("/proc/net/dev", encoding="utf-8") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                return int(rest.split()[8])
    return 0


def worker(out: str, name: str, steps: int) -> None:
    """One rank of one contender (run by ``zerospeed launch``); rank 0 writes OUT/<name>.json."""
    import torch  # noqa: PLC0415 - the driver imports neither torch nor zerospeed

    import zerospeed  # noqa: PLC0415
    from bench_zeropp import _split  # noqa: PLC0415 - the same intra/inter split as the simulated bench
    from zerospeed import comm  # noqa: PLC0415
    from zerospeed.models import GPT, PRESETS  # noqa: PLC0415

    zerospeed.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    model = GPT(PRESETS["bench"](), seed=0)
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0, **contenders()[name]}}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    inter = intra = 0
    sent = torch.zeros(world, dtype=torch.float64)
    losses = []
    for step in range(steps + 1):
        if step == 1:  # after the warm-up step
            comm.barrier()
            sent[rank], t0 = float(_sent_bytes()), time.perf_counter()
            comm.COMMS_LOGGER.reset()
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randint(0, 256, (1, TOKENS + 1), generator=g)
        _, loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    intra, inter = _split(comm.COMMS_LOGGER.snapshot(), RANKS_PER_NODE)
    comm.barrier()
    wall = time.perf_counter() - t0
    sent[rank] = _sent_bytes() - sent[rank]
    comm.all_reduce(sent)
    if rank == 0:
        # one rank per host read its host's counter (local rank 0): add those
        wire = sum(float(sent[r]) for r in range(0, world, RANKS_PER_NODE))
        row = {"contender": name, "params": model.num_params(), "steps": steps, "s_per_step": wall / steps,
               "inter_bytes_per_step": inter / steps, "intra_bytes_per_step": intra / steps,
               "wire_bytes_per_step": wire / steps, "losses": losses}
        with open(os.path.join(out, f"{name}.json"), "w", encoding="utf-8") as f:
            json.dump(row, f)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=SRC + (":" + os.environ["PYTHONPATH"]
                                                                   if os.environ.get("PYTHONPATH") else ""))
    env["PATH"] = f"{os.path.dirname(sys.executable)}:/usr/sbin:/usr/bin:/sbin:/bin"
    return env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rate", default="1gbit", help="tc rate of each host's link ('none': unshaped)")
    p.add_argument("--delay", default=None, help="added latency (netem; refused where the kernel has none)")
    p.add_argument("--only", default="", help="comma-separated contender names (default: all)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", nargs=3, metavar=("OUT", "NAME", "STEPS"), help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return
    from zerospeed.testing.cluster import Cluster, faults, free_port, unavailable_reason  # noqa: PLC0415

    reason = unavailable_reason()
    if reason is not None:  # `make bench` on a machine without root or network namespaces
        print(f"bench_cluster_links: skipped, no test cluster here: {reason}")
        return
    names = [n for n in contenders() if not args.only or n in args.only.split(",")]
    out = tempfile.mkdtemp(prefix="bench-cluster-links-")
    with Cluster(2) as cluster:
        link = "unshaped veth"
        if args.rate != "none":
            for h in cluster.hosts:
                link = faults.shape(h, args.rate, args.delay)
        hostfile = cluster.write_hostfile(os.path.join(out, "hostfile"), slots=RANKS_PER_NODE)
        print(f"GPT[bench] 10.8M params | 2 hosts x {RANKS_PER_NODE} ranks (ssh launcher, Gloo over veth) | link: "
              f"{link} | stage 3 fp32 | micro 1 x {TOKENS} tokens | {args.steps} steps after 1 warm-up")
        print(f"{'contender':<30}{'s/step':>8}{'inter B/step':>15}{'vs ZeRO-3':>10}{'intra B/step':>14}"
              f"{'wire B/step':>14}{'loss':>7}")
        base: dict[str, Any] | None = None
        for name in names:
            argv = [sys.executable, "-m", "zerospeed.launcher.cli", "launch", "--hostfile", hostfile, "--launcher",
                    "ssh", "--master_port", str(free_port()), os.path.abspath(__file__), "--worker", out, name,
                    str(args.steps)]
            done = cluster.run(0, argv, cwd=out, env=_env(), timeout=1800)
            result = Path(out, f"{name}.json")
            if done.returncode != 0 or not result.exists():
                print(f"{name:<30} failed (exit {done.returncode}): {done.stderr[-1500:]}", flush=True)
                continue
            row = {**json.loads(result.read_text()), "link": link}
            base = base or (row if name == "ZeRO-3" else None)
            vs = row["inter_bytes_per_step"] / base["inter_bytes_per_step"] if base else float("nan")
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{name:<30}{row['s_per_step']:>8.2f}{row['inter_bytes_per_step']:>15,.0f}{vs:>10.3f}"
                      f"{row['intra_bytes_per_step']:>14,.0f}{row['wire_bytes_per_step']:>14,.0f}"
                      f"{row['losses'][-1]:>7.3f}", flush=True)
    subprocess.run(["rm", "-rf", out], check=False)


if __name__ == "__main__":
    main()
