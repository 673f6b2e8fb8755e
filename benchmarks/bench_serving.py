"""Serving under load: zerospeed's continuous batching vs Hugging Face static batching vs HF continuous batching.

    .venv/bin/python benchmarks/bench_serving.py [--model llama|gpt2] [--requests 48] [--rate 8] [--prompt 16 256]
        [--output 16 128] [--budget 256] [--static-batch 8] [--threads 1] [--contenders zerospeed hf-static hf-cb]
        [--rounds 3] [--compile] [--json] [--shared-prefix 512]

A load generator replays one mixed workload against each contender in turn, in real time (after one untimed
warm-up pass per contender; ``--rounds`` rounds, each running every contender with the order rotated, so a
load change on a shared machine hits all of them; the ratio to static batching is taken *within* each round): ``--requests``
requests whose prompt and output lengths are drawn uniformly from ``--prompt`` / ``--output`` and whose
arrivals are a Poisson process of ``--rate`` requests per second (``--rate 0``: all at once), all from a
fixed seed; same model (fp32, from a config), same machine, greedy decoding, no eos (every request produces
exactly its output length). Contenders:

* ``zerospeed``: ``ServingEngine`` (paged KV cache, Dynamic SplitFuse with ``--budget`` tokens per forward);
  the driver adds each request when it arrives and calls ``step()`` while there is work.
* ``zerospeed-prefix``: the same with prefix caching on (``ServingEngine(prefix_caching=True)``). With
  ``--shared-prefix N`` every prompt starts with the same N-token system prompt (then its own drawn tokens):
  the shared-prefix workload, e.g. ``--requests 32 --shared-prefix 512 --prompt 16 64 --output 16 32``.
* ``zerospeed-ngram``: the same with prompt-lookup speculative decoding (``--spec-tokens`` drafts per step);
  single-stream decode: ``--requests 1 --prompt 64 64 --output 256 256 --contenders zerospeed zerospeed-ngram``.
* ``zerospeed-draft``: the same with a draft model (``--spec-tokens`` drafts per step). With ``--model zs-corpus``
  the target is a zerospeed GPT of ``--target-shape`` (LAYERSxWIDTH, default 6x128) and the draft one of
  ``--draft-shape`` (default 2x128), both trained ``--train-steps`` steps on the bundled corpus and cached
  (``serving_models.py``), and the prompts are corpus text; ``--temperature T`` samples (exact rejection rule):
  ``--model zs-corpus --requests 1 --prompt 64 64 --output 256 256 --contenders zerospeed zerospeed-draft``.
* ``hf-static``: Hugging Face ``generate`` on static batches of ``--static-batch`` requests in arrival order
  (left-padded; a batch starts when its last request has arrived and the previous batch is done, and runs to
  its longest output). Token times come from a logits processor called once per decode step.
* ``hf-cb``: Hugging Face's own continuous batching (``model.init_continuous_batching``: its paged cache and
  scheduler on a background thread; same page size, block count and token budget), requests added on arrival
  with ``record_timestamps=True``.

Reported: throughput (generated tokens / seconds from the first arrival to the last token), time to first
token (TTFT = first token time - arrival) and time per output token after the first (TPOT), p50 and p99, and
how many requests got exactly the same tokens as zerospeed.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from serving_models import corpus_model

V = 1024
SPEC_STATS: dict = {}


def build(kind: str, train_steps: int = 300, target_shape: str = "6x128") -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "zs-corpus":
        return corpus_model(target_shape, train_steps)
    if kind == "zs-loop":  # zerospeed's GPT (bytes): its greedy text falls into loops (zerospeed contenders only)
        from zerospeed.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig(block_size=1024, n_layer=4, n_head=4, n_embd=128), seed=0).eval()
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=V, n_positions=1024, n_embd=128, n_layer=4, n_head=4,
                                      initializer_range=0.1, eos_token_id=None, bos_token_id=None)
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(cfg).eval()


def workload(n: int, rate: float, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0,
             shared: int = 0):
    """``[(arrival_s, prompt_ids, new_tokens)]`` from a fixed seed: uniform lengths, Poisson arrivals; every
    prompt starts with the same ``shared`` tokens."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, V, (shared,), generator=g).tolist()
    t, out = 0.0, []
    for _ in range(n):
        if rate > 0:
            t += float(torch.empty(1).exponential_(rate, generator=g))
        p = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=g))
        o = int(torch.randint(output[0], output[1] + 1, (1,), generator=g))
        out.append((t, system + torch.randint(0, V, (p,), generator=g).tolist(), o))
    return out


def wait_until(t0: float, at: float) -> None:
    delay = t0 + at - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_zerospeed(model, reqs, args, prefix_caching=False, speculative=None):
    from zerospeed.inference import SamplingParams, ServingEngine

    block = 16
    blocks = sum(math.ceil((len(p) + o) / block) for _, p, o in reqs)
    cfg = {"state_manager": {"max_ragged_batch_size": args.budget, "max_ragged_sequence_count": len(reqs),
                             "max_tracked_sequences": len(reqs), "max_context": 2048, "kv_block_size": block,
                             "memory_config": {"mode": "allocate", "size": blocks}}}
    eng = ServingEngine(model, cfg, compile=args.compile, prefix_caching=prefix_caching, speculative=speculative)
    if speculative is not None:  # the acceptance of the last run of each kind (drafts accepted / proposed)
        SPEC_STATS["zerospeed-draft" if "model" in speculative else "zerospeed-ngram"] = eng
    if args.compile:  # compile outside the timed run
        eng.generate([reqs[0][1], reqs[1][1][:5]], SamplingParams(max_tokens=3))
    uid_of, times, tokens = {}, {}, {}
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(reqs) or eng.has_work:
        now = time.perf_counter() - t0
        while nxt < len(reqs) and reqs[nxt][0] <= now:
            uid = eng.add_request(reqs[nxt][1], SamplingParams(max_tokens=reqs[nxt][2], temperature=args.temperature,
                                                               seed=nxt if args.temperature else None))
            uid_of[uid], times[nxt], tokens[nxt] = nxt, [], []
            nxt += 1
        if not eng.has_work:
            wait_until(t0, reqs[nxt][0])
            continue
        for ev in eng.step():
            i = uid_of[ev.uid]
            times[i].append(time.perf_counter() - t0)
            tokens[i].append(ev.token)
    return times, tokens


def run_hf_static(model, reqs, args):
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        def __init__(self):
            self.stamps = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    times, tokens = {}, {}
    t0 = time.perf_counter()
    for s in range(0, len(reqs), args.static_batch):
        idx = list(range(s, min(len(reqs), s + args.static_batch)))
        wait_until(t0, max(reqs[i][0] for i in idx))
        width = max(len(reqs[i][1]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):
            p = reqs[i][1]
            ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
        clock = Clock()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max(reqs[i][2] for i in idx), do_sample=False,
                                 logits_processor=LogitsProcessorList([clock]), pad_token_id=0)
        stamps = [c - t0 for c in clock.stamps]  # the token of step k exists once its logits are processed
        for row, i in enumerate(idx):
            times[i] = stamps[: reqs[i][2]]
            tokens[i] = out[row, width:width + reqs[i][2]].tolist()
    return times, tokens


def run_hf_cb(model, reqs, args):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    block = 16
    blocks = sum(math.ceil((len(p) + o) / block) for _, p, o in reqs)
    gc = GenerationConfig(max_new_tokens=max(o for *_, o in reqs), do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=block, num_blocks=blocks, max_batch_tokens=args.budget,
                                  max_requests_per_batch=len(reqs))
    manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cb)
    manager.start()
    times, tokens, created = {}, {}, {}
    try:
        t0 = time.perf_counter()
        for i, (at, p, o) in enumerate(reqs):
            wait_until(t0, at)
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=o, record_timestamps=True)
        while len(times) < len(reqs):
            r = manager.get_result(timeout=60)
            if r is None:
                raise RuntimeError("Hugging Face continuous batching stopped answering")
            if r.is_finished():
                i = int(r.request_id[1:])
                times[i] = [s - t0 for s in r.timestamps]
                tokens[i] = list(r.generated_tokens)
    finally:
        manager.stop(block=True, timeout=10)
    return times, tokens


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(math.ceil(q / 100 * len(xs))) - 1)] if xs else float("nan")


def summarize(reqs, times, tokens, ref_tokens):
    ttft = [times[i][0] - reqs[i][0] for i in range(len(reqs))]
    tpot = [(times[i][-1] - times[i][0]) / (len(times[i]) - 1) for i in range(len(reqs)) if len(times[i]) > 1]
    generated = sum(len(tokens[i]) for i in range(len(reqs)))
    span = max(t[-1] for t in times.values()) - reqs[0][0]
    same = sum(tokens[i] == ref_tokens[i] for i in range(len(reqs))) if ref_tokens else None
    return {"tok_per_s": generated / span, "seconds": span, "generated": generated,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
            "same_tokens_as_zerospeed": same}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", choices=["llama", "gpt2", "zs-loop", "zs-corpus"])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second (0: all at once)")
    ap.add_argument("--prompt", type=int, nargs=2, default=[16, 256])
    ap.add_argument("--output", type=int, nargs=2, default=[16, 128])
    ap.add_argument("--budget", type=int, default=256, help="tokens per forward (both continuous batchers)")
    ap.add_argument("--static-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds; each runs every contender (order rotated)")
    ap.add_argument("--compile", action="store_true", help="zerospeed with torch.compile'd regions")
    ap.add_argument("--contenders", nargs="+", default=["zerospeed", "hf-static", "hf-cb"])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--spec-tokens", type=int, default=4, help="zerospeed-ngram: drafts per step")
    ap.add_argument("--repetitive", type=int, default=0,
                    help="prompts repeat a pattern of this many tokens (a repetitive prompt for n-gram drafting)")
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens of a system prompt every request shares")
    ap.add_argument("--train-steps", type=int, default=300, help="zs-corpus: training steps of target and draft")
    ap.add_argument("--target-shape", default="6x128", help="zs-corpus: the target's LAYERSxWIDTH")
    ap.add_argument("--draft-shape", default="2x128", help="zs-corpus: the draft's LAYERSxWIDTH")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="zerospeed contenders: sampling temperature (seed = request index; 0: greedy)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.model, args.train_steps, args.target_shape)
    draft = corpus_model(args.draft_shape, args.train_steps) if "zerospeed-draft" in args.contenders else None
    reqs = workload(args.requests, args.rate, tuple(args.prompt), tuple(args.output), args.seed,
                    args.shared_prefix)
    if args.model == "zs-loop":  # a byte vocabulary
        reqs = [(t, [x % 256 for x in p], o) for t, p, o in reqs]
    if args.model == "zs-corpus":  # prompts of corpus text (from its val end: not what the models saw most)
        from zerospeed.data import load_corpus

        text = load_corpus()[-200_000:]
        reqs = [(t, list(text[(7919 * i) % 190_000:][:len(p)]), o) for i, (t, p, o) in enumerate(reqs)]
    if args.repetitive:
        reqs = [(t, (p[:args.repetitive] * (len(p) // args.repetitive + 1))[:len(p)], o) for t, p, o in reqs]
    runners = {"zerospeed": run_zerospeed, "hf-static": run_hf_static, "hf-cb": run_hf_cb,
               "zerospeed-prefix": lambda m, r, a: run_zerospeed(m, r, a, prefix_caching=True),
               "zerospeed-ngram": lambda m, r, a: run_zerospeed(m, r, a, speculative={
                   "method": "ngram", "num_speculative_tokens": a.spec_tokens}),
               "zerospeed-draft": lambda m, r, a: run_zerospeed(m, r, a, speculative={
                   "model": draft, "num_speculative_tokens": a.spec_tokens})}
    warm = [(0.0, p, min(o, 8)) for _, p, o in reqs[:8]]
    for name in args.contenders:  # untimed: first-call costs (allocator, oneDNN, compile) out of the figures
        runners[name](model, warm, args)
    rounds: list[dict[str, dict]] = []
    ref = None
    for k in range(args.rounds):
        order = args.contenders[k % len(args.contenders):] + args.contenders[:k % len(args.contenders)]
        results = {}
        for name in order:
            c0 = time.process_time()
            times, tokens = runners[name](model, reqs, args)
            if name == "zerospeed" and ref is None:
                ref = tokens
            results[name] = {"contender": name, **summarize(reqs, times, tokens, ref), "cpu_s": time.process_time() - c0}
        rounds.append(results)
    print(f"# {args.model}, {args.requests} requests (shared prefix {args.shared_prefix}), Poisson rate {args.rate}/s, prompts {args.prompt[0]}-"
          f"{args.prompt[1]}, outputs {args.output[0]}-{args.output[1]}, budget {args.budget}, static batch "
          f"{args.static_batch}, threads {args.threads}, compile {args.compile}, {args.rounds} interleaved rounds")
    for k, results in enumerate(rounds):
        base = results.get("hf-static")
        for r in results.values():
            r["round"] = k
            if base:
                r["x_static"] = r["tok_per_s"] / base["tok_per_s"]
                r["x_static_cpu"] = base["cpu_s"] / r["cpu_s"]
            if args.json:
                print(json.dumps(r))
            else:
                print(f"r{k} {r['contender']:<10} {r['tok_per_s']:8.1f} tok/s ({r['seconds']:6.2f} s, cpu "
                      f"{r['cpu_s']:6.2f} s)  x{r.get('x_static', float('nan')):.2f} static"
                      f" (cpu x{r.get('x_static_cpu', float('nan')):.2f}) | TTFT p50 {r['ttft_p50']:6.3f} p99 "
                      f"{r['ttft_p99']:6.3f} s | TPOT p50 {1000 * r['tpot_p50']:6.1f} p99 {1000 * r['tpot_p99']:6.1f}"
                      f" ms | same tokens {r['same_tokens_as_zerospeed']}/{args.requests}")
    if all("zerospeed" in r and "zerospeed-prefix" in r for r in rounds):
        ttft = sorted(r["zerospeed"]["ttft_p50"] / r["zerospeed-prefix"]["ttft_p50"] for r in rounds)
        tput = sorted(r["zerospeed-prefix"]["tok_per_s"] / r["zerospeed"]["tok_per_s"] for r in rounds)
        print(f"# prefix caching, paired per round: TTFT p50 {', '.join(f'{x:.2f}' for x in ttft)}x lower "
              f"(median {ttft[len(ttft) // 2]:.2f}); tok/s {', '.join(f'{x:.2f}' for x in tput)}x "
              f"(median {tput[len(tput) // 2]:.2f})")
    for spec in ("zerospeed-ngram", "zerospeed-draft"):
        if all("zerospeed" in r and spec in r for r in rounds):
            tput = sorted(r[spec]["tok_per_s"] / r["zerospeed"]["tok_per_s"] for r in rounds)
            print(f"# {spec} speculation, paired per round: tok/s {', '.join(f'{x:.2f}' for x in tput)}x "
                  f"(median {tput[len(tput) // 2]:.2f}); last run accepted "
                  f"{SPEC_STATS[spec].accepted}/{SPEC_STATS[spec].drafted} drafts")
    if all("hf-static" in r for r in rounds):
        for name in args.contenders:
            wall = sorted(r[name]["x_static"] for r in rounds)
            cpu = sorted(r[name]["x_static_cpu"] for r in rounds)
            print(f"# {name}: paired x static per round (tok/s) {', '.join(f'{x:.2f}' for x in wall)}; median "
                  f"{wall[len(wall) // 2]:.2f}; by CPU s median {cpu[len(cpu) // 2]:.2f}")


if __name__ == "__main__":
    main()
