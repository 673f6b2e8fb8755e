"""Tensor-parallel inference: tp=2 vs tp=1 decode time and per-rank memory (CPU, Gloo, measured).

    .venv/bin/python benchmarks/bench_inference_tp.py [--model llama|gpt2] [--width 512] [--layers 4]
                                                     [--batch 4] [--prompt 32] [--new 32] [--quant int8|int4]
                                                     [--json]

tp=1 runs in this process; tp=2 runs on two forked Gloo ranks (``zerospeed.testing.run_distributed``), one
torch thread per rank. Same model (fp32, from a config, same seed), same prompts, greedy. Reported per rank:
bytes of the parameters it holds and of its KV cache for this batch (measured from the tensors), decode
wall and CPU ms per step (after one warm-up call), and whether the tokens equal tp=1's. ``--quant`` quantizes
the linear weights (INT8 symmetric / INT4 asymmetric, per channel: one group per row of each shard) after sharding; the bytes of the
linear weights each rank holds (codes + scales, measured) are reported too.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch


def build(kind: str, width: int, layers: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=4096, n_positions=1024, n_embd=width, n_layer=layers, n_head=width // 64,
            eos_token_id=None, bos_token_id=None)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=4096, hidden_size=width, intermediate_size=width * 8 // 3 // 64 * 64, num_hidden_layers=layers,
        num_attention_heads=width // 64, num_key_value_heads=width // 128, max_position_embeddings=1024,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)).eval()


def measure(args: argparse.Namespace, tp: int) -> dict:
    import zerospeed
    from zerospeed.inference.kv_cache import blocks_needed

    torch.set_num_threads(1)
    model = build(args.model, args.width, args.layers)
    kw: dict = {"tensor_parallel": {"tp_size": tp}} if tp > 1 else {}
    if args.quant:
        bits = 8 if args.quant == "int8" else 4
        kw["quant"] = {"weight": {"num_bits": bits, "q_type": "symmetric" if bits == 8 else "asymmetric",
                                  "q_groups": 1}}
    eng = zerospeed.init_inference(model, dtype="fp32", **kw)
    ids = torch.randint(0, 4096, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    eng.generate(ids, max_new_tokens=2)
    w, c = time.perf_counter(), time.process_time()
    out = eng.generate(ids, max_new_tokens=args.new)
    wall, cpu = time.perf_counter() - w, time.process_time() - c
    a = eng.adapter
    slots = args.batch * blocks_needed(args.prompt + args.new, 16) * 16
    from zerospeed.inference.quantization import model_bytes

    return {"tp": tp, "param_bytes": model_bytes(model), "linear_bytes": model_bytes(model, linear_weights_only=True),
            "kv_bytes": 2 * a.num_layers * a.num_kv_heads * slots * a.head_dim * 4,
            "ms_step_wall": 1000 * wall / args.new, "ms_step_cpu": 1000 * cpu / args.new, "tokens": out.tolist()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", choices=["llama", "gpt2"])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--quant", default=None, choices=["int8", "int4"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from zerospeed.testing import run_distributed

    one = measure(args, 1)
    two = run_distributed(measure, 2, args, 2, timeout=1800)
    print(f"# {args.model} width {args.width} layers {args.layers}, batch {args.batch}, prompt {args.prompt}, "
          f"new {args.new}, quant {args.quant}; CPU, Gloo, 1 thread per rank")
    for r, row in [("-", one), *((str(i), x) for i, x in enumerate(two))]:
        row = dict(row, rank=r, same_tokens_as_tp1=row["tokens"] == one["tokens"])
        row.pop("tokens")
        if args.json:
            print(json.dumps(row))
        else:
            print(f"tp={row['tp']} rank {r}: tensors {row['param_bytes'] / 2**20:7.2f} MiB (linear weights "
                  f"{row['linear_bytes'] / 2**20:7.2f} MiB), KV cache "
                  f"{row['kv_bytes'] / 2**20:6.2f} MiB, {row['ms_step_wall']:7.1f} ms/step wall "
                  f"{row['ms_step_cpu']:7.1f} cpu, same tokens as tp=1: {row['same_tokens_as_tp1']}")


if __name__ == "__main__":
    main()
