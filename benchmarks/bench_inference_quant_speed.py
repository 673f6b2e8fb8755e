"""INT8 / INT4 vs fp32 at inference: decode step time, weight bytes, resident memory (CPU, measured).

    .venv/bin/python benchmarks/bench_inference_quant_speed.py [--preset bench] [--width W --layers L]
                                                              [--batch 1 8] [--new 32]
                                                              [--rounds 2] [--threads 1] [--json]

Each variant runs in its own fresh process (so peak RSS is its own): build the preset GPT (random weights,
fp32), ``init_inference`` with the variant's ``quant``, then greedy ``generate`` of ``--new`` tokens after a
32-token prompt for each ``--batch``. Reported per variant: bytes of the linear weights and of all tensors
(measured from the tensors held), RSS after quantizing (fp32 copy freed, heap trimmed), peak RSS of the process (includes
the fp32 model it was quantized from), and the best-of-``--rounds`` ms per decode step (wall and CPU).
Variants: fp32; INT8 symmetric per channel and INT4 asymmetric (64 columns per group), each with
``kernel: dequant`` (rebuild the float weight per forward) and ``kernel: int`` (PyTorch's int kernels).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import resource
import subprocess
import sys
import time

import torch

VARIANTS = {
    "fp32": None,
    "int8 dequant": {"num_bits": 8, "q_type": "symmetric", "q_groups": 1, "kernel": "dequant"},
    "int8 int-kernel": {"num_bits": 8, "q_type": "symmetric", "q_groups": 1, "kernel": "int"},
    "int4 dequant": {"num_bits": 4, "q_type": "asymmetric", "group": 64, "kernel": "dequant"},
    "int4 int-kernel": {"num_bits": 4, "q_type": "asymmetric", "group": 64, "kernel": "int"},
}


def rss_bytes() -> int:
    """Resident bytes now, after handing freed heap pages back to the OS (glibc keeps them otherwise)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def child(args: argparse.Namespace) -> dict:
    import zerospeed
    from zerospeed.inference.quantization import model_bytes
    from zerospeed.models import PRESETS, GPT

    torch.set_num_threads(args.threads)
    cfg = PRESETS[args.preset]()
    if args.width:
        cfg = dataclasses.replace(cfg, n_embd=args.width, n_head=args.width // 64, n_layer=args.layers or cfg.n_layer)
    q = VARIANTS[args.variant]
    kwargs: dict = {"dtype": "fp32"}
    if q is not None:
        q = dict(q)
        group = q.pop("group", None)
        if group:
            # q_groups counts groups per row: 64 columns in n_embd-wide layers, 256 in the 4x-wide MLP output
            q["q_groups"] = cfg.n_embd // group
        kwargs["quant"] = {"weight": q}
    model = GPT(cfg, seed=0).eval()
    fp32_linear = model_bytes(model, linear_weights_only=True)
    eng = zerospeed.init_inference(model, **kwargs)
    del model
    gc.collect()
    out = {"variant": args.variant, "linear_bytes": model_bytes(eng.module, linear_weights_only=True),
           "fp32_linear_bytes": fp32_linear, "model_bytes": model_bytes(eng.module), "rss_after_load": rss_bytes()}
    g = torch.Generator().manual_seed(0)
    for b in args.batch:
        ids = torch.randint(0, cfg.vocab_size, (b, 32), generator=g)
        eng.generate(ids, max_new_tokens=2)  # warm-up
        w, c = time.perf_counter(), time.process_time()
        tokens = eng.generate(ids, max_new_tokens=args.new)
        out[f"b{b}_ms_step_wall"] = 1000 * (time.perf_counter() - w) / args.new
        out[f"b{b}_ms_step_cpu"] = 1000 * (time.process_time() - c) / args.new
        out[f"b{b}_tokens"] = tokens[:, 32:].tolist()
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--width", type=int, default=0, help="override the preset's n_embd (heads of 64)")
    ap.add_argument("--layers", type=int, default=0, help="override the preset's n_layer (with --width)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(child(args)))
        return
    best: dict[str, dict] = {}
    for _ in range(args.rounds):  # interleaved: every variant once per round
        for v in args.variants:
            cmd = [sys.executable, __file__, "--variant", v, "--preset", args.preset, "--width", str(args.width),
                   "--layers", str(args.layers), "--new", str(args.new),
                   "--threads", str(args.threads), "--batch", *map(str, args.batch)]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            prev = best.get(v)
            if prev is None:
                best[v] = r
            else:
                for k in r:
                    if k.endswith(("_wall", "_cpu")):
                        prev[k] = min(prev[k], r[k])
    ref = best.get("fp32")
    print(f"# preset {args.preset} width {args.width or 'preset'} layers {args.layers or 'preset'}, {args.new} new "
          f"tokens after a 32-token prompt, threads {args.threads}, "
          f"best of {args.rounds} rounds; ms per decode step (wall / cpu)")
    for v, r in best.items():
        same = {b: ref is not None and r[f"b{b}_tokens"] == ref[f"b{b}_tokens"] for b in args.batch}
        row = {k: val for k, val in r.items() if not k.endswith("_tokens")}
        row["linear_ratio"] = r["linear_bytes"] / r["fp32_linear_bytes"]
        row["greedy_tokens_equal_fp32"] = same
        if args.json:
            print(json.dumps(row))
            continue
        steps = "  ".join(f"b{b}: {r[f'b{b}_ms_step_wall']:6.1f} / {r[f'b{b}_ms_step_cpu']:6.1f}" for b in args.batch)
        print(f"{v:<16} linear {r['linear_bytes'] / 2**20:6.2f} MiB ({row['linear_ratio']:.3f}x) all "
              f"{r['model_bytes'] / 2**20:6.2f} MiB | RSS loaded {r['rss_after_load'] / 2**20:6.0f} MiB peak "
              f"{r['peak_rss'] / 2**20:6.0f} MiB | {steps} | same tokens as fp32 {same}")


if __name__ == "__main__":
    main()
