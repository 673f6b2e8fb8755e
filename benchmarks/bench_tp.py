"""Tensor parallelism (AutoTP) vs data parallelism vs ZeRO-3 on the same GPT, in the same run.

Contenders (each in its own forked Gloo ranks, same model, seed and global batch; fp32, AdamW):
  tp=1 (one rank), tp=2, tp=2 + sequence parallelism, dp=2 (ZeRO 0), dp=2 ZeRO-3.
Reported per contender: median wall and CPU seconds per step (max over ranks), peak RSS per rank (measured),
parameters + optimizer state per rank (measured: bytes of the distinct live storages after the steps) and its
ratio to tp=1, and for the tensor-parallel runs the TP collective bytes per step seen by the comms logger next
to the per-layer theory (``parallel/tensor/accounting.py``), and the last loss (a sanity check).

    python benchmarks/bench_tp.py [--steps 4] [--layers 4] [--dim 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zerospeed.profiling.memory import peak_rss_bytes  # noqa: E402
from zerospeed.testing import run_distributed  # noqa: E402

MiB = 1024 * 1024
VOCAB, SEQ = 256, 128


def _state_bytes(engine: Any) -> int:
    seen: dict[int, int] = {}
    opt = engine.optimizer
    tensors = list(engine.module.parameters())
    tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)] if opt else []
    tensors += [p for g in (opt.groups if opt else []) for p in g.master_params]
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _run(tp: int, sp: bool, stage: int, steps: int, layers: int, dim: int, batch: int) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm
    from zerospeed.models.gpt import GPT, GPTConfig

    world = comm.get_world_size()
    dp = world // tp
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=layers, n_head=8, n_embd=dim), seed=0)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch // dp, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp, "sequence_parallel": sp}
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    rank = comm.get_rank(engine.dp_group)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (steps, batch, SEQ + 1), generator=g)
    walls, cpus, tp_bytes, loss = [], [], {}, 0.0
    for s in range(steps):
        x = data[s, rank * (batch // dp):(rank + 1) * (batch // dp)]
        comm.COMMS_LOGGER.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        _, out = engine(x[:, :-1], x[:, 1:])
        engine.backward(out)
        engine.step()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        tp_bytes = {op: st.bytes for op, st in comm.COMMS_LOGGER.snapshot().items()}
        loss = float(out.detach())
    expected = None
    if tp > 1:
        from zerospeed.parallel.tensor.accounting import expected_tp_bytes

        expected = expected_tp_bytes(engine.module, (batch // dp) * SEQ)
    return {"wall": statistics.median(walls[1:] or walls), "cpu": statistics.median(cpus[1:] or cpus),
            "rss": peak_rss_bytes(), "state": _state_bytes(engine), "comm": tp_bytes, "expected": expected,
            "loss": loss}


CONTENDERS = [("tp=1 (1 rank)", 1, 1, False, 0), ("tp=2", 2, 2, False, 0), ("tp=2 + sp", 2, 2, True, 0),
              ("dp=2", 2, 1, False, 0), ("dp=2 ZeRO-3", 2, 1, False, 3)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for name, world, tp, sp, stage in CONTENDERS:
        res = run_distributed(_run, world, tp, sp, stage, args.steps, args.layers, args.dim, args.batch, timeout=1800)
        rows.append({"contender": name, "wall_s": max(r["wall"] for r in res), "cpu_s": max(r["cpu"] for r in res),
                     "peak_rss_mib": max(r["rss"] for r in res) / MiB, "state_mib": max(r["state"] for r in res) / MiB,
                     "tp_comm": res[0]["comm"] if tp > 1 else None, "tp_theory": res[0]["expected"],
                     "loss": res[0]["loss"]})
    base = rows[0]["state_mib"]
    for r in rows:
        r["state_vs_tp1"] = r["state_mib"] / base
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"GPT {args.layers} layers, dim {args.dim}, seq {SEQ}, global batch {args.batch}, fp32, {args.steps} steps")
    print(f"{'contender':<16}{'wall s':>8}{'cpu s':>8}{'RSS MiB':>9}{'params+opt MiB':>16}{'vs tp=1':>9}{'loss':>8}")
    for r in rows:
        print(f"{r['contender']:<16}{r['wall_s']:>8.3f}{r['cpu_s']:>8.3f}{r['peak_rss_mib']:>9.0f}"
              f"{r['state_mib']:>16.2f}{r['state_vs_tp1']:>9.3f}{r['loss']:>8.4f}")
    for r in rows:
        if r["tp_comm"] is not None:
            seen = {k: r["tp_comm"].get(k, 0) for k in r["tp_theory"]}
            print(f"{r['contender']}: TP bytes/step measured {seen} vs theory {r['tp_theory']}")


if __name__ == "__main__":
    main()
