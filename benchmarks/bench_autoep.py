"""AutoEP and the hybrid engine, measured (issue 34): paired contenders on the same model and data, same run.

Part ``autoep`` (world 2, fp32, AdamW): a Hugging Face Mixtral built from a config (8 experts, top-2) trained
with plain ZeRO-3 (experts partitioned like any parameter) against AutoEP ``autoep_size`` 2 (each rank holds half
the experts, tokens moved by all-to-all) under ZeRO-2 and under ZeRO-3. The contenders alternate (A B C A B C)
so machine load hits them alike. Reported: median wall and CPU seconds per step (max over ranks), tokens per
second per rank, peak RSS per rank, last loss.

Part ``hybrid`` (world 2, ZeRO-3): rollout tokens per second of ``engine.generate`` (hybrid engine: weights
gathered once per phase, static KV cache) against Hugging Face ``generate`` on the same ZeRO-3 module under
``GatheredParameters``, alternating; then, in fresh ranks and on a wider GPT-2 (768 wide, 8 layers, 58M
parameters: 220 MiB of fp32 weights per rank when gathered), the peak RSS (``measure_memory``: the kernel's
high-water mark reset at the start) of DeepSpeed-Chat's experience phase (2 ``generate`` calls, then the actor
and a frozen ZeRO-3 reference score the rollouts) and of the training step after it, and the RSS after the
``generate`` calls, with and without ``release_inference_cache`` (alternating, fresh ranks each).

    python benchmarks/bench_autoep.py [--part autoep|hybrid|all] [--steps 4] [--rounds 2] [--json]
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

from transformers import GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM  # noqa: E402

import zerospeed  # noqa: E402
from zerospeed import comm  # noqa: E402
from zerospeed.profiling.memory import measure_memory, peak_rss_bytes, rss_bytes  # noqa: E402
from zerospeed.profiling.memory_timeline import malloc_trim  # noqa: E402
from zerospeed.testing import run_distributed  # noqa: E402

MiB = 1024 * 1024
VOCAB, SEQ, MB = 1024, 128, 4


def _mixtral() -> MixtralForCausalLM:
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=SEQ, output_router_logits=True, router_aux_loss_coef=0.01,
                        tie_word_embeddings=False)
    return MixtralForCausalLM(cfg).float()


def _moe_config(stage: int, ep: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": MB, "gradient_clipping": 1.0,
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                           "zero_optimization": {"stage": stage}}
    if ep > 1:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    return cfg


def _train(stage: int, ep: int, steps: int) -> dict[str, Any]:
    engine = zerospeed.initialize(model=_mixtral(), config=_moe_config(stage, ep))[0]
    walls, cpus, loss = [], [], 0.0
    for step in range(steps + 1):  # step 0 warms up
        g = torch.Generator().manual_seed(1000 * step + comm.get_rank())
        ids = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
        t0, c0 = time.perf_counter(), time.process_time()
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        if step:
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        loss = float(out.loss)
    return {"wall": statistics.median(walls), "cpu": statistics.median(cpus), "rss": peak_rss_bytes(), "loss": loss}


def autoep_part(steps: int, rounds: int) -> list[dict[str, Any]]:
    contenders = [("ZeRO-3, no AutoEP", 3, 1), ("AutoEP ep=2, ZeRO-2", 2, 2), ("AutoEP ep=2, ZeRO-3", 3, 2)]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in contenders}
    for _ in range(rounds):
        for name, stage, ep in contenders:
            per_rank = run_distributed(_train, 2, stage, ep, steps, timeout=1800)
            runs[name].append({k: max(r[k] for r in per_rank) for k in ("wall", "cpu", "rss")} |
                              {"loss": per_rank[0]["loss"]})
    rows = []
    for name, rs in runs.items():
        wall = statistics.median(r["wall"] for r in rs)
        rows.append({"part": "autoep", "contender": name, "s_per_step": wall,
                     "cpu_s_per_step": statistics.median(r["cpu"] for r in rs),
                     "tokens_per_s_per_rank": MB * SEQ / wall, "peak_rss_mib": max(r["rss"] for r in rs) / MiB,
                     "last_loss": rs[-1]["loss"], "walls": [round(r["wall"], 3) for r in rs]})
    return rows


def _gpt2(width: int = 256, layers: int = 4) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=width, n_layer=layers, n_head=4, bos_token_id=0,
                     eos_token_id=VOCAB + 1, pad_token_id=0)
    return GPT2LMHeadModel(cfg)


def _hybrid_config(release: bool) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MB, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "hybrid_engine": {"enabled": True, "max_out_tokens": 96, "release_inference_cache": release}}


def _prompts(call: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (MB, 32), generator=torch.Generator().manual_seed(call + 7 * comm.get_rank()))


def _rollout_speed(calls: int, new: int) -> dict[str, Any]:
    engine = zerospeed.initialize(model=_gpt2(), config=_hybrid_config(False))[0]
    params = list(engine.module.parameters())
    times: dict[str, list[float]] = {"hybrid": [], "hf_gathered": []}
    engine.eval()
    for call in range(calls + 1):  # call 0 warms up both
        for kind in ("hybrid", "hf_gathered"):
            ids = _prompts(call)
            t0 = time.perf_counter()
            if kind == "hybrid":
                out = engine.generate(ids, max_new_tokens=new, do_sample=False)
            else:
                with zerospeed.zero.GatheredParameters(params), torch.no_grad():
                    out = engine.module.generate(ids, max_new_tokens=new, do_sample=False)
            if call:
                times[kind].append(time.perf_counter() - t0)
            assert out.shape[1] == ids.shape[1] + new
    return {k: statistics.median(v) for k, v in times.items()}


def _rollout_memory(release: bool, new: int, width: int, layers: int) -> dict[str, Any]:
    """DeepSpeed-Chat's experience step, then a training step: the actor generates twice, then the actor and a
    frozen ZeRO-3 reference score the rollouts in the same phase (weights gathered per layer), then it trains."""
    engine = zerospeed.initialize(model=_gpt2(width, layers), config=_hybrid_config(release))[0]
    ref = zerospeed.initialize(model=_gpt2(width, layers), config={"train_micro_batch_size_per_gpu": MB,
                               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})[0]
    ref.eval()
    malloc_trim()  # the whole models built before partitioning: their freed heap must not hide the gathers
    start = rss_bytes()
    with measure_memory() as phase:
        engine.eval()
        seqs = [engine.generate(_prompts(call), max_new_tokens=new, do_sample=False) for call in range(2)]
        after_generate = rss_bytes()
        with torch.no_grad():
            for seq in seqs:  # log-probs of the actor and the reference on the rollouts
                engine(input_ids=seq).logits.log_softmax(-1)
                ref(input_ids=seq).logits.log_softmax(-1)
    with measure_memory() as step:
        engine.train()
        ids = _prompts(9)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    return {"start": start, "phase_peak": phase.peak_bytes, "step_peak": step.peak_bytes,
            "after_generate": after_generate}


def hybrid_part(calls: int, rounds: int, new: int = 48, width: int = 768, layers: int = 8) -> list[dict[str, Any]]:
    speed: dict[str, list[float]] = {"hybrid": [], "hf_gathered": []}
    for _ in range(rounds):
        for r in run_distributed(_rollout_speed, 2, calls, new, timeout=1800):
            for k, v in r.items():
                speed[k].append(v)
    rows = [{"part": "hybrid", "contender": "engine.generate (hybrid engine)" if k == "hybrid" else
             "HF generate under GatheredParameters", "s_per_rollout": statistics.median(v),
             "tokens_per_s_per_rank": MB * new / statistics.median(v), "s_per_rollout_all": [round(x, 3) for x in v]}
            for k, v in speed.items()]
    for _ in range(rounds):
        for release in (False, True):
            per_rank = run_distributed(_rollout_memory, 2, release, new, width, layers, timeout=1800)
            rows.append({"part": "hybrid_rss", "release_inference_cache": release,
                         **{f"{k}_over_start_mib": [round((r[k] - r["start"]) / MiB) for r in per_rank]
                            for k in ("phase_peak", "step_peak", "after_generate")},
                         "peak_rss_mib": max(max(r["phase_peak"], r["step_peak"]) / MiB for r in per_rank)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", default="all", choices=["autoep", "hybrid", "all"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    if args.part in ("autoep", "all"):
        rows += autoep_part(args.steps, args.rounds)
    if args.part in ("hybrid", "all"):
        rows += hybrid_part(args.steps, args.rounds)
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
