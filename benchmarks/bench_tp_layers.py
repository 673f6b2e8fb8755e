"""Tensor-parallel layers: activation bytes per rank with and without Megatron sequence parallelism.

A stack of pre-LN transformer blocks (fused GQA QKV column + row projection, packed gate/up SwiGLU MLP) is run
unsplit (tp=1) and at tp=2 / tp=4 over forked Gloo ranks, plain and with ``sequence_parallel=True``.
Reported per rank: bytes of activations autograd keeps for backward (*measured*: every tensor handed to
``saved_tensors_hooks``, parameters excluded, shared storage counted once), split into the LayerNorm
regions and the whole forward, and the median wall seconds of forward+backward (few steps; a loaded machine
makes these noisy).

    python benchmarks/bench_tp_layers.py [--hidden 256] [--seq 256] [--layers 2] [--steps 3] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from zerospeed import comm  # noqa: E402
from zerospeed.parallel.tensor import (AutoTPMeta, FusedQKVLinear, GateUpPack_LinearLayer, LinearAllreduce,  # noqa: E402
                                       SequenceParallelGradSync, gather_from_sequence_parallel_region,
                                       scatter_to_sequence_parallel_region)
from zerospeed.testing import run_distributed  # noqa: E402


class Block(nn.Module):
    def __init__(self, h: int, heads: int, kv: int) -> None:
        super().__init__()
        self.hd, self.heads, self.kv = h // heads, heads, kv
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, (heads + 2 * kv) * self.hd), nn.Linear(h, h)
        self.gate_up, self.down = nn.Linear(h, 8 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.ln1(x))
        b, s, _ = qkv.shape
        q, k, v = qkv.split([self.heads * self.hd, self.kv * self.hd, self.kv * self.hd], dim=-1)
        q = q.view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = (z.view(b, s, self.kv, self.hd).transpose(1, 2).repeat_interleave(self.heads // self.kv, 1)
                for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(y)
        g, u = self.gate_up(self.ln2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


def _parallelise(model: nn.Sequential, group: Any, sp: bool, heads: int, kv: int) -> None:
    for i, blk in enumerate(model):
        blk.qkv = FusedQKVLinear(blk.qkv, group, heads, kv, name=f"{i}.attn.qkv", sequence_parallel=sp)
        blk.heads, blk.kv = blk.qkv.local_heads
        blk.proj = LinearAllreduce(blk.proj, group, name=f"{i}.attn.proj", tp_meta=AutoTPMeta(num_kv_heads=kv),
                                   sequence_parallel=sp)
        blk.gate_up = GateUpPack_LinearLayer(blk.gate_up, group, name=f"{i}.mlp.gate_up", sequence_parallel=sp)
        blk.down = LinearAllreduce(blk.down, group, name=f"{i}.mlp.down", sequence_parallel=sp)
    if sp:
        SequenceParallelGradSync([p for b in model for p in (*b.ln1.parameters(), *b.ln2.parameters())], group)


def _measure(args: argparse.Namespace, sp: bool, tp: int) -> dict[str, Any]:
    group = comm.world_group() if tp > 1 else None
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.hidden, args.heads, args.kv) for _ in range(args.layers)])
    if tp > 1:
        _parallelise(model, group, sp, args.heads, args.kv)
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[str, dict[int, int]] = {"all": {}, "ln": {}}
    region = ["all"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            for key in {"all", region[0]}:
                seen[key][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for blk in model:
        for ln in (blk.ln1, blk.ln2):
            ln.register_forward_pre_hook(lambda m, a: region.__setitem__(0, "ln"))
            ln.register_forward_hook(lambda m, a, o: region.__setitem__(0, "all"))
    x = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1))
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            inner = scatter_to_sequence_parallel_region(x, group) if sp else x
            y = model(inner)
            y = gather_from_sequence_parallel_region(y, group, tensor_parallel_output_grad=False) if sp else y
        if step == 0:
            saved = {k: sum(v.values()) for k, v in seen.items()}
        y.square().mean().backward()
        times.append(time.perf_counter() - t0)
    return {"ln_bytes": saved["ln"], "saved_bytes": saved["all"], "s_per_step": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [("tp=1", _measure(args, False, 1))]
    for tp in args.tp:
        for sp in (False, True):
            per_rank = run_distributed(_measure, tp, args, sp, tp, timeout=600)
            rows.append((f"tp={tp}{' +SP' if sp else ''}", max(per_rank, key=lambda r: r["saved_bytes"])))
    base = rows[0][1]
    print(f"{'contender':<10} {'LN-region KiB':>14} {'x tp=1':>7} {'saved KiB':>10} {'x tp=1':>7} {'s/step':>7}")
    for name, r in rows:
        if args.json:
            print(json.dumps({"contender": name, **r}))
        print(f"{name:<10} {r['ln_bytes'] / 1024:>14.0f} {r['ln_bytes'] / base['ln_bytes']:>7.3f} "
              f"{r['saved_bytes'] / 1024:>10.0f} {r['saved_bytes'] / base['saved_bytes']:>7.3f} {r['s_per_step']:>7.3f}")


if __name__ == "__main__":
    main()
