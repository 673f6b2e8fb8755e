"""ZeRO-Infinity headline: a GPT whose training state (16 bytes/parameter: fp32 weights, gradients, Adam's
two moments) exceeds this machine's memory trains with its parameters and optimizer state on disk.

Stage 3 on one rank, fp32 compute (bf16 matmuls are ~170x slower on this CPU), a tiny batch. The model is
built under ``zerospeed.zero.Init`` with ``offload_param: nvme``, so each layer's weights go to their swap
file as soon as the layer is constructed: the model is never whole in memory. Training reads each
module's weights back from disk before its forward and again before its backward (read ahead in the
recorded order), the optimizer streams Adam's moments through ``offload_optimizer: nvme``, and the updated
weights are written back. The fp32 master goes straight from the weights' swap files into the optimizer's
at ``initialize()`` (it is never whole in memory), and each sub-group's reduced gradients are streamed to
its swap file during backward: no model-sized tensor stays in RAM.

Reported: parameters, total state, peak RSS of ``initialize()`` and of training, seconds per step (wall and
CPU), bytes on disk, bytes read and written per step. Swap files are removed at the end. Check ``df -h DIR``
first: the files need ~20 bytes per parameter (weights 4, master 4, Adam 8, gradients 4).

    python benchmarks/bench_infinity.py --dir /work [--d_model 4096 --layers 10 --seq 32 --steps 3]
    python benchmarks/bench_infinity.py --dir /work --layers 20 --max_in_cpu 1000000000   # 4.03B, 60 GiB
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.models.gpt import Block, GPTConfig

GiB = 1 << 30


class BigGPT(nn.Module):
    """The bundled GPT's blocks, untied head, PyTorch's default initialisation inside each constructor
    (so ``zero.Init`` sees every layer's final values as it is attached)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def count(cfg: GPTConfig) -> int:
    d, v, t, n = cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.n_layer
    block = 12 * d * d + 13 * d  # qkv, proj, fc, proj weights and biases, two LayerNorms
    return n * block + 2 * v * d + t * d + 2 * d


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


def run(args: argparse.Namespace, root: str) -> dict[str, Any]:
    import zerospeed
    from zerospeed.zero import Init

    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.d_model // 128,
                    n_embd=args.d_model)
    ds = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
          "zero_optimization": {
              "stage": 3, "sub_group_size": args.sub_group, "stage3_prefetch_bucket_size": args.prefetch,
              "reduce_bucket_size": args.prefetch,
              "stage3_max_live_parameters": 3 * args.prefetch,
              "offload_param": {"device": "nvme", "nvme_path": root, "buffer_count": 2,
                                "buffer_size": args.prefetch, "max_in_cpu": args.max_in_cpu},
              "offload_optimizer": {"device": "nvme", "nvme_path": root, "buffer_count": 3}},
          "aio": {"block_size": 4 << 20, "intra_op_parallelism": 2}}
    t0 = time.perf_counter()
    with Init(config_dict_or_path=ds):
        model = BigGPT(cfg)
    built_s, built_rss = time.perf_counter() - t0, rss_gib()
    engine, opt, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    setup_s, setup_rss = time.perf_counter() - t0, rss_gib()
    home, stepper = engine.zero3.param_home, opt.stepper
    from zerospeed.profiling.memory import MemoryTracker

    tracker = MemoryTracker()
    tracker.reset_peak()  # the training peak, separately from initialize()'s
    gen = torch.Generator().manual_seed(0)
    rows = []
    for step in range(args.steps):
        idx = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen)
        r0, w0 = home.swapper.bytes_read + stepper.swapper.bytes_read, home.swapper.bytes_written + stepper.swapper.bytes_written
        w_start, c_start = time.perf_counter(), time.process_time()
        loss = engine(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        t_fb = time.perf_counter() - w_start
        engine.step()
        rows.append({"step": step, "loss": float(loss.detach()), "wall_s": time.perf_counter() - w_start,
                     "cpu_s": time.process_time() - c_start, "fwd_bwd_s": t_fb,
                     "read_gib": (home.swapper.bytes_read + stepper.swapper.bytes_read - r0) / GiB,
                     "written_gib": (home.swapper.bytes_written + stepper.swapper.bytes_written - w0) / GiB,
                     "optimizer": dict(stepper.last_stats)})
        print(json.dumps(rows[-1]), flush=True)
    disk = home.disk_bytes() + stepper.disk_bytes()
    du = sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(root) for f in fs)  # allocated
    out = {"params": sum(s.numel for s in engine.zero3.shards), "state_gib": 16 * count(cfg) / GiB,
           "build_s": built_s, "setup_s": setup_s, "rss_after_build_gib": built_rss, "rss_after_setup_gib": setup_rss,
           "peak_rss_gib": rss_gib(), "train_peak_rss_gib": tracker.peak_bytes() / GiB, "disk_gib": disk / GiB, "du_gib": du / GiB, "steps": rows,
           "memory": {k: v / GiB for k, v in engine.memory_breakdown().items()}}
    home.close()
    stepper.close(restore=False)  # the fp32 master (8 GB here) would not fit back next to the gradients
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/work")
    ap.add_argument("--d_model", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sub_group", type=int, default=25_000_000)
    ap.add_argument("--prefetch", type=int, default=50_000_000)
    ap.add_argument("--max_in_cpu", type=int, default=0, help="offload_param.max_in_cpu: weight elements kept "
                    "in host memory instead of their swap files")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.d_model // 128,
                    n_embd=args.d_model)
    n = count(cfg)
    need = (20 * n - 4 * min(args.max_in_cpu, n)) * 1.02
    free = shutil.disk_usage(args.dir).free
    print(f"model: {n / 1e9:.2f}B parameters, training state {16 * n / GiB:.1f} GiB; disk needed ~{need / GiB:.1f} GiB, "
          f"free {free / GiB:.1f} GiB under {args.dir}", flush=True)
    if free < need:
        raise SystemExit(f"not enough free disk under {args.dir}")
    root = tempfile.mkdtemp(prefix="bench_infinity_", dir=args.dir)
    try:
        out = run(args, root)
    finally:
        gc.collect()
        shutil.rmtree(root, ignore_errors=True)
    out["left_on_disk"] = os.path.exists(root)
    if args.json:
        print(json.dumps(out))
        return
    steps = out["steps"][1:] or out["steps"]
    wall = sorted(r["wall_s"] for r in steps)[len(steps) // 2]
    cpu = sorted(r["cpu_s"] for r in steps)[len(steps) // 2]
    losses = ", ".join(f"{r['loss']:.3f}" for r in out["steps"])
    print("| parameters | state | peak RSS (setup) | peak RSS (training) | disk | s/step wall | s/step CPU | read/step "
          "| written/step | losses |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    print(f"| {out['params'] / 1e9:.2f}B | {out['state_gib']:.1f} GiB | {out['rss_after_setup_gib']:.1f} GiB | "
          f"{out['train_peak_rss_gib']:.1f} GiB | "
          f"{out['du_gib']:.1f} GiB | {wall:.0f} | {cpu:.0f} | {steps[-1]['read_gib']:.1f} GiB | "
          f"{steps[-1]['written_gib']:.1f} GiB | {losses} |")
    print(json.dumps({k: v for k, v in out.items() if k != "steps"}))


if __name__ == "__main__":
    main()
