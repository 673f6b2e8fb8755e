"""Serving throughput: continuous batching vs one request at a time, on a small GPT-2 shape (CPU).

    .venv/bin/python benchmarks/bench_serving.py [--requests 16] [--new 32] [--budget 256] [--threads 1] [--json]

Same random prompts (16..64 tokens), greedy, fp32. Contenders: Hugging Face ``generate`` one request at a
time; zerospeed ``init_inference(...).generate`` one at a time; zerospeed ``ServingEngine`` with all requests
submitted at once (Dynamic SplitFuse, ``--budget`` tokens per forward). Reports generated tokens per wall
second and per CPU second, and checks that all three produce the same tokens.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady figures on a shared machine)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import GPT2Config, GPT2LMHeadModel

    import zerospeed
    from zerospeed.inference import SamplingParams, ServingEngine

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=256, n_embd=128, n_layer=4, n_head=4,
                                       eos_token_id=None, bos_token_id=None)).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1024, (int(torch.randint(16, 65, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.requests)]
    with torch.no_grad():
        hf, hf_w, hf_c = timed(lambda: [model.generate(torch.tensor([p]), max_new_tokens=args.new, do_sample=False)
                                        [0, len(p):].tolist() for p in prompts])
    eng = zerospeed.init_inference(model, dtype="fp32")
    zs, zs_w, zs_c = timed(lambda: [eng.generate(torch.tensor([p]), max_new_tokens=args.new)[0, len(p):].tolist()
                                    for p in prompts])
    cfg = {"state_manager": {"max_ragged_batch_size": args.budget, "max_ragged_sequence_count": args.requests,
                             "max_tracked_sequences": args.requests, "kv_block_size": 16,
                             "memory_config": {"mode": "allocate", "size": args.requests * 8}}}
    serving = ServingEngine(model, cfg)
    reqs, sv_w, sv_c = timed(lambda: serving.generate(prompts, SamplingParams(max_tokens=args.new)))
    sv = [r.output for r in reqs]
    same = hf == zs == sv
    total = args.requests * args.new
    rows = [("hf generate, one at a time", hf_w, hf_c), ("zerospeed generate, one at a time", zs_w, zs_c),
            (f"zerospeed serving, {args.requests} concurrent", sv_w, sv_c)]
    print(f"# {args.requests} requests x {args.new} new tokens, prompts 16-64, budget {args.budget}, "
          f"forwards {serving.forwards}, identical tokens: {same}")
    for name, w, c in rows:
        if args.json:
            print(json.dumps({"contender": name, "wall_s": w, "cpu_s": c, "tok_per_s": total / w, "same": same}))
        else:
            print(f"{name:<36} {w:7.2f} s wall {c:7.2f} s cpu  {total / w:8.1f} tok/s  {total / c:8.1f} tok/cpu-s")


if __name__ == "__main__":
    main()
