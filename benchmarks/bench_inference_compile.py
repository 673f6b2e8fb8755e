"""Decode speed: eager vs torch.compile'd regions (``init_inference(..., replace_with_kernel_inject=True)``).

    .venv/bin/python benchmarks/bench_inference_compile.py [--model gpt2|llama] [--width 128] [--layers 4]
                                                          [--batch 4] [--prompt 32] [--new 64]
                                                          [--repeats 3] [--threads 1] [--json]

Same model (fp32, from a config), same prompts, greedy. Each contender is warmed up once (compilation is
reported apart), then timed ``--repeats`` times interleaved with the other; the best wall/CPU time is kept.
Checks that the compiled tokens equal the eager ones and Hugging Face ``generate``'s.
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
        cfg = transformers.GPT2Config(vocab_size=1024, n_positions=512, n_embd=width, n_layer=layers, n_head=width // 32,
                                      eos_token_id=None, bos_token_id=None)
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=width, intermediate_size=width * 8 // 3,
                                   num_hidden_layers=layers, num_attention_heads=width // 32,
                                   num_key_value_heads=width // 64, max_position_embeddings=512,
                                   eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(cfg).eval()


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2", choices=["gpt2", "llama"])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import zerospeed

    model = build(args.model, args.width, args.layers)
    ids = torch.randint(0, 1024, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=args.new, do_sample=False)
    engines = {"eager": zerospeed.init_inference(copy.deepcopy(model), dtype="fp32"),
               "compiled": zerospeed.init_inference(copy.deepcopy(model), dtype="fp32", replace_with_kernel_inject=True)}
    first, best, same = {}, {}, {}
    for name, eng in engines.items():
        out, w, _ = timed(lambda: eng.generate(ids, max_new_tokens=args.new))
        first[name], same[name] = w, torch.equal(out, ref)
    for _ in range(args.repeats):
        for name, eng in engines.items():
            _, w, c = timed(lambda: eng.generate(ids, max_new_tokens=args.new))
            bw, bc = best.get(name, (float("inf"), float("inf")))
            best[name] = (min(bw, w), min(bc, c))
    tokens = args.batch * args.new
    print(f"# {args.model} width {args.width} layers {args.layers} batch {args.batch} prompt {args.prompt} "
          f"new {args.new}, threads {args.threads}; "
          f"tokens equal HF generate: {same}")
    for name in engines:
        w, c = best[name]
        row = {"contender": name, "first_call_s": first[name], "wall_s": w, "cpu_s": c,
               "ms_per_step": 1000 * w / args.new, "tok_per_s": tokens / w, "same_as_hf": same[name],
               "speedup_vs_eager_wall": best["eager"][0] / w, "speedup_vs_eager_cpu": best["eager"][1] / c}
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{name:<9} first call {first[name]:6.1f} s | best {w:6.3f} s wall {c:6.3f} s cpu | "
                  f"{row['ms_per_step']:6.2f} ms/step {row['tok_per_s']:7.0f} tok/s | x{row['speedup_vs_eager_wall']:.2f} "
                  f"wall x{row['speedup_vs_eager_cpu']:.2f} cpu")


if __name__ == "__main__":
    main()
