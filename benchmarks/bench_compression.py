"""DeepSpeed's compression library on the demo GPT (issue 35): QAT vs PTQ, head pruning, layer reduction.

    .venv/bin/python benchmarks/bench_compression.py [--steps 120] [--tune 30] [--block 64] [--int4-group 64]
                                                     [--int4-sym] [--seeds 1] [--only quant,heads,layers] [--json]

One process, fp32, AdamW, the bundled corpus. A base model trains ``--steps`` steps, then each variant trains
``--tune`` more steps from it (layer reduction: ``2 * --tune``) and is measured on ``--windows`` validation
windows:

* ``fp32`` (the base trained ``--tune`` more steps, the reference), PTQ INT8 / INT4 of it through
  ``init_inference``'s own quantization, and QAT INT8 / INT4 (``quantize_weight_in_forward``, the same groups)
  exported with ``compression.export.export_quantized`` and served by ``init_inference``: perplexity; with
  ``--seeds N``, for each of N data orders of the ``--tune`` steps (paired: the fp32 reference and both QAT runs
  of one seed see the same batches), then each variant's mean, standard deviation and range over the seeds, and
  those of the paired differences QAT - PTQ and QAT - fp32;
* 50 % head pruning (learned top-k scores on each attention projection, ``related_modules`` the QKV) then
  ``redundancy_clean``: parameters and forward tokens/s before and after, perplexity;
* layer reduction 4 -> 2 (teacher layers 1 and 3, embeddings and final norm copied) trained with distillation
  (``(CE + KL(teacher || student)) / 2``) vs the 2-layer model trained from scratch on CE: validation loss.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from bench_inference_quant import perplexity

import zerospeed
from zerospeed.compression import init_compression, redundancy_clean
from zerospeed.compression.export import export_quantized
from zerospeed.compression.scheduler import CompressionScheduler
from zerospeed.data import ByteDataset
from zerospeed.models import PRESETS, GPT

Loss = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def ce(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y)[1]


def train(model: torch.nn.Module, steps: int, batch: int, block: int, loss_fn: Loss = ce, seed: int = 0) -> Any:
    data = ByteDataset(block, "train")
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(data), (batch,), generator=g).tolist()
        x, y = (torch.stack(t) for t in zip(*(data[i] for i in idx)))
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    return model.eval()


def compressed(base: GPT, section: dict[str, Any]) -> GPT:
    model = copy.deepcopy(base)
    init_compression(model, {"compression_training": section})
    CompressionScheduler(model, section).step(step_zero_check=True)  # the techniques whose schedule_offset is 0
    return model


def qat_section(bits: int, groups: int, symmetric: bool) -> dict[str, Any]:
    return {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "quantize_groups": groups,
                              "quantization_type": "symmetric" if symmetric else "asymmetric"},
        "different_groups": {"all": {"params": {"start_bits": bits, "target_bits": bits}, "modules": [r"blocks\."]}}}}


@torch.no_grad()
def tokens_per_s(model: torch.nn.Module, block: int, repeat: int = 5) -> tuple[float, float]:
    x = torch.randint(0, 256, (16, block))
    model(x)
    t, c = time.perf_counter(), time.process_time()
    for _ in range(repeat):
        model(x)
    n = repeat * x.numel()
    return n / (time.perf_counter() - t), n / (time.process_time() - c)


def quantization_rows(base: GPT, args: argparse.Namespace, block: int) -> Iterator[dict[str, Any]]:
    """fp32 / PTQ / QAT rows for each tune seed (the data order of the ``--tune`` steps, shared by the fp32
    reference and both QAT runs of that seed: paired), as each is measured, then the mean and spread."""
    rows: list[dict[str, Any]] = []
    for seed in range(1, args.seeds + 1):
        for r in _quantization_seed(base, args, block, seed):
            rows.append({"seed": seed, **r})
            yield rows[-1]
    if args.seeds > 1:
        yield from _spread(rows)


def _quantization_seed(base: GPT, args: argparse.Namespace, block: int, seed: int) -> Iterator[dict[str, Any]]:
    ref = train(copy.deepcopy(base), args.tune, args.batch, block, seed=seed)
    n_embd = base.config.n_embd
    yield {"variant": "fp32", "ppl": perplexity(ref, block, args.windows)}
    per_row = args.int4_group == 0  # INT4 with one scale per row: the hard case for PTQ
    int4_groups = 1 if per_row else n_embd // args.int4_group
    for bits, sym, qgroups in ((8, True, 1), (4, args.int4_sym, int4_groups)):
        q = {"num_bits": bits, "q_type": "symmetric" if sym else "asymmetric", "q_groups": qgroups}
        eng = zerospeed.init_inference(copy.deepcopy(ref), dtype="fp32", quant={"weight": q})
        yield {"variant": f"PTQ int{bits}", "ppl": perplexity(eng.module, block, args.windows)}
        # DeepSpeed's groups cut the flattened weight: one group per row (INT8) / per int4_group columns (INT4)
        qat = compressed(base, qat_section(bits, 1, sym))
        for m in qat.modules():
            if getattr(m, "weight_quant", None) is not None:
                per = 1 if bits == 8 or per_row else m.weight.shape[1] // args.int4_group
                m.weight_quant.groups = m.weight.shape[0] * per
        train(qat, args.tune, args.batch, block, seed=seed)
        export_quantized(qat)
        eng = zerospeed.init_inference(qat, dtype="fp32")
        yield {"variant": f"QAT int{bits}", "ppl": perplexity(eng.module, block, args.windows)}


def _spread(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and sample standard deviation over the seeds of each variant, and of the paired QAT - PTQ and
    QAT - fp32 differences (same seed)."""
    by: dict[str, dict[int, float]] = {}
    for r in rows:
        by.setdefault(r["variant"], {})[r["seed"]] = r["ppl"]
    series = dict(by)
    for bits in (8, 4):
        qat, ptq, fp = by[f"QAT int{bits}"], by[f"PTQ int{bits}"], by["fp32"]
        series[f"QAT int{bits} - PTQ int{bits}"] = {s: qat[s] - ptq[s] for s in qat}
        series[f"QAT int{bits} - fp32"] = {s: qat[s] - fp[s] for s in qat}
    out = []
    for name, vals in series.items():
        v = torch.tensor(list(vals.values()), dtype=torch.float64)
        out.append({"variant": f"{name} over {len(v)} seeds", "mean": v.mean().item(), "std": v.std().item(),
                    "min": v.min().item(), "max": v.max().item()})
    return out


def head_rows(base: GPT, args: argparse.Namespace, block: int) -> list[dict[str, Any]]:
    heads = base.config.n_head
    section = {"head_pruning": {"shared_parameters": {"enabled": True, "num_heads": heads, "schedule_offset": 0},
                                "different_groups": {"h": {"params": {"dense_ratio": 0.5}, "modules": [r"attn\.proj"],
                                                           "related_modules": [[r"attn\.qkv"]]}}}}
    dense = train(copy.deepcopy(base), args.tune, args.batch, block, seed=1)
    pruned = train(compressed(base, section), args.tune, args.batch, block, seed=1)
    before = (dense.num_params(), *tokens_per_s(dense, block), perplexity(dense, block, args.windows))
    masked_ppl = perplexity(pruned, block, args.windows)
    redundancy_clean(pruned, {"compression_training": section})
    after = (pruned.num_params(), *tokens_per_s(pruned, block), perplexity(pruned, block, args.windows))
    keys = ("params", "tokens_per_s_wall", "tokens_per_s_cpu", "ppl")
    return [{"variant": "dense (4 heads)", **dict(zip(keys, before))},
            {"variant": "50% heads pruned, masked", "ppl": masked_ppl},
            {"variant": "50% heads pruned + redundancy_clean", **dict(zip(keys, after))}]


def distill(teacher: GPT) -> Loss:
    def loss(student: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits, hard = student(x, y)
        with torch.no_grad():
            target = teacher(x)[0]
        kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(target, -1), log_target=True, reduction="batchmean")
        return 0.5 * hard + 0.5 * kl / x.shape[1]
    return loss


@torch.no_grad()
def val_loss(model: torch.nn.Module, block: int, windows: int) -> float:
    return math.log(perplexity(model, block, windows))


def layer_rows(base: GPT, args: argparse.Namespace, block: int) -> list[dict[str, Any]]:
    small = replace(base.config, n_layer=2)
    lr = {"enabled": True, "keep_number_layer": 2, "module_name_prefix": "blocks", "teacher_layer": [1, 3],
          "other_module_name": ["wte", "wpe", "ln_f"]}
    student = GPT(small, seed=5)
    init_compression(student, {"compression_training": {"layer_reduction": lr}}, teacher_model=base)
    at_init = val_loss(student, block, args.windows)
    train(student, 2 * args.tune, args.batch, block, distill(base), seed=1)
    scratch = train(GPT(small, seed=5), 2 * args.tune, args.batch, block, seed=1)
    return [{"variant": "teacher (4 layers)", "val_loss": val_loss(base, block, args.windows)},
            {"variant": "student 2 layers, teacher init, at step 0", "val_loss": at_init},
            {"variant": f"student 2 layers, teacher init + distillation, {2 * args.tune} steps",
             "val_loss": val_loss(student, block, args.windows)},
            {"variant": f"2 layers from scratch, {2 * args.tune} steps", "val_loss": val_loss(scratch, block, args.windows)}]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--tune", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=1, help="quant: tune seeds (data orders) 1..N, with mean and spread")
    ap.add_argument("--int4-group", type=int, default=64, help="INT4 columns per scale; 0: one scale per row")
    ap.add_argument("--int4-sym", action="store_true", help="INT4 symmetric (default asymmetric)")
    ap.add_argument("--only", default="quant,heads,layers", help="comma-separated parts: quant, heads, layers")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = PRESETS["demo"]()
    t0 = time.time()
    base = train(GPT(cfg, seed=0), args.steps, args.batch, args.block)
    print(f"# demo GPT params={base.num_params()} base steps={args.steps} tune={args.tune} batch={args.batch}x"
          f"{args.block} windows={args.windows} (base trained in {time.time() - t0:.0f} s)", flush=True)
    parts = {"quant": quantization_rows, "heads": head_rows, "layers": layer_rows}
    for name, fn in parts.items():
        if name not in args.only.split(","):
            continue
        for row in fn(base, args, args.block):
            print(json.dumps({"part": name, **row}) if args.json else
                  f"{name:6s} " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
