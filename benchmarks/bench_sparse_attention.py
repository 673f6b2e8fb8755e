"""Block-sparse attention (``SparseSelfAttention``, DeepSpeed's fixed layout) vs dense SDPA as the sequence grows.

Contenders, one forward + backward of attention on (batch, heads, seq, head_dim) fp32 tensors:

* ``sparse``       ``zerospeed.ops.sparse_attention.SparseSelfAttention`` with ``FixedSparsityConfig``
                   (block-wise in PyTorch: only the layout's blocks are computed and stored);
* ``sparse chunked`` the same with ``chunk_blocks``: whole rows ``--chunk-blocks`` blocks at a time, each chunk
                   recomputed in backward (less memory, one more forward pass of work);
* ``dense sdpa``   ``F.scaled_dot_product_attention`` without a mask (full attention; on CPU torch picks its
                   flash kernel, which never stores the seq x seq scores);
* ``masked sdpa``  the same call with the layout as a boolean (seq x seq) mask: the dense way to get the same
                   result as ``sparse``. It stores seq² entries, so it is skipped past ``--masked-max``.

Memory is *measured*, in a first pass of each: on CPU the peak resident set of the process during the pass
minus the resident set at its start (``/proc/self/clear_refs`` resets the kernel's peak; glibc is told to
``mmap`` every allocation over 64 KiB so freed tensors leave the resident set); on CUDA the allocator's peak
above the start. Time is then the median wall time (and CPU time of the process, steadier on a shared
machine) of ``--repeat`` forward + backward passes, with glibc back at its usual steady state (mmap threshold
32 MiB) so that freed memory is reused rather than faulted in again.
Inputs are allocated before the measurement starts, so it counts what attention itself adds.

    PYTHONPATH=src python benchmarks/bench_sparse_attention.py [--seqs 1024,2048,4096,8192,16384] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from zerospeed.ops.sparse_attention import FixedSparsityConfig, SparseSelfAttention
from zerospeed.profiling.memory import measure_memory

MiB = 1024 * 1024


def _mallopt(trim_threshold: int, mmap_threshold: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, trim_threshold)  # M_TRIM_THRESHOLD: free heap top above this goes back to the OS
        libc.mallopt(-3, mmap_threshold)  # M_MMAP_THRESHOLD: allocations above this are their own mapping
    except OSError:
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor],
             device: torch.device) -> tuple[float, float, int]:
    """One forward + backward: (wall seconds, CPU seconds of the process, measured peak bytes above the start)."""
    for t in inputs:
        t.grad = None
    gc.collect()
    _sync(device)
    with measure_memory(device) as mem:
        start, cpu = time.perf_counter(), time.process_time()
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
        _sync(device)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        del out
    return seconds, cpu, mem.growth_bytes


def timed(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], device: torch.device,
          repeat: int) -> dict[str, float]:
    runs = [run_once(fn, inputs, device) for _ in range(repeat)]
    return {"seconds": statistics.median(r[0] for r in runs), "cpu_seconds": statistics.median(r[1] for r in runs)}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--local-blocks", type=int, default=16, help="FixedSparsityConfig.num_local_blocks")
    ap.add_argument("--chunk-blocks", type=int, default=2048, help="chunk_blocks of the 'sparse chunked' contender")
    ap.add_argument("--attention", default="bidirectional", choices=["bidirectional", "unidirectional"])
    ap.add_argument("--dense-max", type=int, default=16384, help="longest sequence for dense sdpa")
    ap.add_argument("--masked-max", type=int, default=4096, help="longest sequence for masked sdpa (seq² mask)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    seqs = [int(s) for s in args.seqs.split(",")]
    cfg = FixedSparsityConfig(num_heads=args.heads, block=args.block, num_local_blocks=args.local_blocks,
                              attention=args.attention)
    sparse = SparseSelfAttention(cfg, max_seq_length=max(seqs)).to(device)
    chunked = SparseSelfAttention(cfg, max_seq_length=max(seqs), chunk_blocks=args.chunk_blocks).to(device)

    def contenders(seq: int) -> dict[str, Callable[..., torch.Tensor]]:
        out: dict[str, Callable[..., torch.Tensor]] = {"sparse": sparse, "sparse chunked": chunked}
        if seq <= args.dense_max:
            out["dense sdpa"] = F.scaled_dot_product_attention
        if seq <= args.masked_max:
            keep = sparse.get_layout(seq).bool().repeat_interleave(args.block, 1).repeat_interleave(args.block, 2)
            out["masked sdpa"] = lambda q, k, v, m=keep.to(device): F.scaled_dot_product_attention(q, k, v,
                                                                                                  attn_mask=m)
        return out

    def inputs_for(seq: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seq)
        shape = (args.batch, args.heads, seq, args.head_dim)
        return [torch.randn(shape, generator=gen).to(device).requires_grad_() for _ in range(3)]

    rows: dict[tuple[int, str], dict[str, Any]] = {}
    # Phase 1, memory: every allocation over 64 KiB its own mapping, so a freed tensor leaves the resident set.
    if device.type == "cpu":
        _mallopt(0, 64 * 1024)
    for i, seq in enumerate(seqs):
        inputs = inputs_for(seq)
        for name, fn in contenders(seq).items():
            if i == 0:
                run_once(fn, inputs, device)  # warm-up (kernels, allocator, the sparse block table)
            rows[seq, name] = {"seq": seq, "contender": name, "density": float(sparse.get_layout(seq).float().mean()),
                               "peak_mib": run_once(fn, inputs, device)[2] / MiB, "device": str(device),
                               "heads": args.heads, "head_dim": args.head_dim, "batch": args.batch, "block": args.block}
        del inputs
    # Phase 2, time: glibc's usual steady state (its dynamic mmap threshold ends at 32 MiB), freed memory reused.
    if device.type == "cpu":
        _mallopt(128 * MiB, 32 * MiB)
    for seq in seqs:
        inputs = inputs_for(seq)
        for name, fn in contenders(seq).items():
            rows[seq, name].update(timed(fn, inputs, device, args.repeat))
            if args.json:
                print(json.dumps(rows[seq, name]), flush=True)
        del inputs
    if not args.json:
        _table(list(rows.values()), args, seqs)
    return list(rows.values())


def _table(rows: list[dict[str, Any]], args: argparse.Namespace, seqs: list[int]) -> None:
    print(f"fwd+bwd of attention, batch {args.batch}, {args.heads} heads x {args.head_dim}, fp32, {args.device}; "
          f"FixedSparsityConfig(block={args.block}, num_local_blocks={args.local_blocks}, {args.attention}); "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    names = ["sparse", "sparse chunked", "dense sdpa", "masked sdpa"]
    print("| seq | layout density | " + " | ".join(f"{n} wall s" for n in names) + " | "
          + " | ".join(f"{n} cpu s" for n in names) + " | " + " | ".join(f"{n} MiB" for n in names)
          + " | sparse / dense cpu |")
    print("|---" * (3 + 3 * len(names)) + "|")
    for seq in seqs:
        by = {r["contender"]: r for r in rows if r["seq"] == seq}

        def cell(name: str, key: str, fmt: str) -> str:
            return format(by[name][key], fmt) if name in by else "skipped"

        ratio = (f"{by['sparse']['cpu_seconds'] / by['dense sdpa']['cpu_seconds']:.2f}x" if "dense sdpa" in by
                 else "-")
        cells = [cell(n, "seconds", ".3f") for n in names] + [cell(n, "cpu_seconds", ".3f") for n in names] \
            + [cell(n, "peak_mib", ".0f") for n in names]
        print(f"| {seq:,} | {by['sparse']['density']:.3f} | " + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    main()
