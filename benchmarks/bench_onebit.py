"""1-bit optimizers and top-k vs their full-precision twins: the demo GPT, same data and seed, forked Gloo ranks.

    python benchmarks/bench_onebit.py --steps 300 --world 2 [--warmup-frac 0.2] [--freeze-frac 0.2] [--json]
        [--only Adam,OneBitAdam]

Each contender trains ``GPT(demo)`` (1.9M parameters) for ``--steps`` optimizer steps at stage 0 (the 1-bit
optimizers refuse ZeRO, as in DeepSpeed), micro-batch 8 x seq 128 per rank, with each global batch drawn
from the bundled corpus by a seeded generator, so every contender sees identical data. Reported per
contender: first loss, mean loss of the last 20 steps, the ratio of that to its baseline's, communication
per step counted by the comms logger (ring volume in bytes: all-reduce = 2 x message) in the warm-up
phase (step 2; for top-k, which compresses from the start, the dense baseline's) and in the last step,
and wall seconds per step. ``--warmup-frac`` gives every contender the same linear learning-rate warm-up
(DeepSpeed's WarmupLR); ``OneBitAdam-nocomp`` is DeepSpeed's update with no compression at all. A benchmark prints figures; it asserts
nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from zerospeed.data import ByteDataset
from zerospeed.models import GPT, PRESETS
from zerospeed.testing import run_distributed

MICRO = 8
LR = 1e-3


def contenders(steps: int, freeze_frac: float = 0.2) -> dict[str, tuple[dict[str, Any], str]]:
    """name -> (config extras, the baseline it is compared with). Compression starts at ``freeze_frac``."""
    freeze = max(2, int(steps * freeze_frac))
    adam = {"type": "Adam", "params": {"lr": LR}}
    table = {
        "Adam": (adam, "Adam"),
        "OneBitAdam": ({"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": freeze}}, "Adam"),
        # DeepSpeed's recommended (default) var_update_scaler 16, local_step_scaler 32678, local_step_clipper 16
        "ZeroOneAdam": ({"type": "ZeroOneAdam", "params": {"lr": LR, "var_freeze_step": freeze}}, "Adam"),
        "ZeroOneAdam-local": ({"type": "ZeroOneAdam", "params": {"lr": LR, "var_freeze_step": freeze,
                                                                  "var_update_scaler": 16, "local_step_scaler": 32,
                                                                  "local_step_clipper": 4}}, "Adam"),
        "Lamb": ({"type": "Lamb", "params": {"lr": 1e-2}}, "Lamb"),
        "OneBitLamb": ({"type": "OneBitLamb", "params": {"lr": 1e-2, "freeze_step": freeze}}, "Lamb"),
    }
    out = {name: ({"optimizer": opt}, base) for name, (opt, base) in table.items()}
    # DeepSpeed's 1-bit Adam has no bias correction: after a short warm-up the frozen variance is small
    # (1 - 0.999^60 = 6 % of its unbiased value at step 60), which inflates the compressed steps. beta2 0.99
    # lets it settle within the warm-up (1 - 0.99^60 = 45 %); the baseline gets the same betas.
    fast_v = {"lr": LR, "betas": [0.9, 0.99]}
    out["Adam-b2.99"] = ({"optimizer": {"type": "Adam", "params": fast_v}}, "Adam-b2.99")
    out["OneBitAdam-b2.99"] = ({"optimizer": {"type": "OneBitAdam", "params": {**fast_v, "freeze_step": freeze}}},
                               "Adam-b2.99")
    # beta2 0.95: a variance memory of ~20 steps, settled (1 - 0.95^60 = 95 %) when the variance freezes at 60
    fast_v = {"lr": LR, "betas": [0.9, 0.95]}
    out["Adam-b2.95"] = ({"optimizer": {"type": "Adam", "params": fast_v}}, "Adam-b2.95")
    out["ZeroOneAdam-b2.95"] = ({"optimizer": {"type": "ZeroOneAdam", "params": {**fast_v,
                                                                                  "var_freeze_step": freeze}}},
                                "Adam-b2.95")
    out["OneBitAdam-b2.95"] = ({"optimizer": {"type": "OneBitAdam", "params": {**fast_v, "freeze_step": freeze}}},
                               "Adam-b2.95")
    # DeepSpeed's own update without compression (freeze_step beyond the run): separates the cost of
    # compression from that of the missing bias correction.
    out["OneBitAdam-nocomp"] = ({"optimizer": {"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": 10**9}}},
                                "Adam")
    # zerospeed_bias_correction (zerospeed only): torch Adam's warm-up and a bias-corrected frozen variance
    out["OneBitAdam-zbc"] = ({"optimizer": {"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": freeze,
                                                                             "zerospeed_bias_correction": True}}},
                             "Adam")
    out["ZeroOneAdam-zbc"] = ({"optimizer": {"type": "ZeroOneAdam", "params": {"lr": LR, "var_freeze_step": freeze,
                                                                               "zerospeed_bias_correction": True}}},
                              "Adam")
    out["TopK-1%"] = ({"optimizer": adam, "gradient_compression": {"type": "topk", "ratio": 0.01}}, "Adam")
    out["TopK-10%"] = ({"optimizer": adam, "gradient_compression": {"type": "topk", "ratio": 0.1}}, "Adam")
    # A dense warm-up as long as the 1-bit optimizers' (gradient_compression.warmup_steps), then top-k 1 %: with
    # Adam's variance live (-warm); frozen (-fv); frozen, each rank's momentum exchanged (DGC's momentum
    # correction, -dgc; stage 1: -dgc-z1); the same at 2 %, which still moves 1/25 of the fp32 all-reduce at world 2.
    warm = {"type": "topk", "ratio": 0.01, "warmup_steps": freeze}
    frozen = {**warm, "freeze_variance": True}
    dgc = {**frozen, "momentum_correction": True}
    out["TopK-1%-warm"] = ({"optimizer": adam, "gradient_compression": warm}, "Adam")
    out["TopK-1%-fv"] = ({"optimizer": adam, "gradient_compression": frozen}, "Adam")
    out["TopK-1%-dgc"] = ({"optimizer": adam, "gradient_compression": dgc}, "Adam")
    out["TopK-1%-dgc-z1"] = ({"optimizer": adam, "gradient_compression": dgc, "zero_optimization": {"stage": 1}},
                             "Adam")
    # 1-bit Adam's exchange with top-k: each rank's error-compensated momentum (momentum_exchange), per-rank
    # top-k (-mx) or exact at the union of the ranks' indices (-mxu); -w100: a dense warm-up of 100 steps (33 %)
    mx = {**frozen, "momentum_exchange": True}
    out["TopK-1%-mx"] = ({"optimizer": adam, "gradient_compression": mx}, "Adam")
    out["TopK-1%-mxu"] = ({"optimizer": adam, "gradient_compression": {**mx, "union_indices": True}}, "Adam")
    w100 = {"warmup_steps": max(2, steps // 3)}
    out["TopK-1%-mx-w100"] = ({"optimizer": adam, "gradient_compression": {**mx, **w100}}, "Adam")
    out["TopK-1%-mxu-w100"] = ({"optimizer": adam, "gradient_compression": {**mx, **w100, "union_indices": True}},
                               "Adam")
    # -l: local_variance (each rank's own live variance; the preconditioned momentum is exchanged)
    out["TopK-1%-mxul"] = ({"optimizer": adam, "gradient_compression": {**mx, "union_indices": True,
                                                                         "local_variance": True}}, "Adam")
    out["TopK-1%-mxl-w100"] = ({"optimizer": adam, "gradient_compression": {**mx, **w100, "local_variance": True}},
                               "Adam")
    out["TopK-1%-mxul-w100"] = ({"optimizer": adam, "gradient_compression": {**mx, **w100, "union_indices": True,
                                                                              "local_variance": True}}, "Adam")
    out["TopK-2%-dgc"] = ({"optimizer": adam, "gradient_compression": {**dgc, "ratio": 0.02}}, "Adam")
    return out


def batch(data: ByteDataset, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    idx = torch.randint(len(data), (MICRO * world,), generator=g)[rank * MICRO:(rank + 1) * MICRO].tolist()
    return torch.stack([data[i][0] for i in idx]), torch.stack([data[i][1] for i in idx])


def run(extras: dict[str, Any], steps: int, warmup: int = 0) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    cfg = PRESETS["demo"]()
    model = GPT(cfg, seed=0)
    data = ByteDataset(cfg.block_size, "train")
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": 0}, **extras}
    if warmup > 0:  # the same linear learning-rate warm-up for every contender (DeepSpeed's WarmupLR)
        lr = extras["optimizer"]["params"]["lr"]
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                              "warmup_num_steps": warmup, "warmup_type": "linear"}}
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses, volumes, t0 = [], [], 0.0
    for step in range(steps):
        if step == 1:
            t0 = time.perf_counter()
        x, y = batch(data, step, rank, world)
        before = comm.COMMS_LOGGER.total_volume()
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        volumes.append(comm.COMMS_LOGGER.total_volume() - before)
        total = loss.detach().clone()
        comm.all_reduce(total)  # the logged volume of this reporting all-reduce is outside the step's window
        losses.append(float(total) / world)
    return {"losses": losses, "volumes": volumes, "s_per_step": (time.perf_counter() - t0) / max(1, steps - 1)}


def _tail(losses: list[float], n: int = 20) -> float:
    tail = losses[-n:]
    return sum(tail) / len(tail)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated contender names (default: all; a compressed one "
                                              "is compared with its baseline only when that runs first)")
    p.add_argument("--freeze-frac", type=float, default=0.2, help="share of the steps before compression starts")
    p.add_argument("--warmup-frac", type=float, default=0.0,
                   help="share of the steps with a linear learning-rate warm-up (WarmupLR), for every contender")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    table = contenders(args.steps, args.freeze_frac)
    names = [n for n in table if not args.only or n in args.only.split(",")]
    results: dict[str, dict[str, Any]] = {}
    n_params = GPT(PRESETS["demo"](), seed=0).num_params()
    print(f"GPT[demo] {n_params / 1e6:.2f}M params | world {args.world} | micro {MICRO} x seq 128 | {args.steps} steps"
          f" | compression from {args.freeze_frac:.0%} | lr warm-up {args.warmup_frac:.0%}")
    print(f"{'optimizer':<12}{'first':>8}{'last20':>9}{'vs base':>9}{'warm B/step':>14}{'last B/step':>14}"
          f"{'ratio':>8}{'s/step':>8}")
    for name in names:
        extras, base = table[name]
        r = run_distributed(run, args.world, extras, args.steps, int(args.steps * args.warmup_frac),
                            timeout=6 * 3600)[0]
        results[name] = r
        last20 = _tail(r["losses"])
        base_r = results.get(base)
        vs = last20 / _tail(base_r["losses"]) if base_r else float("nan")
        warm, last = r["volumes"][1], r["volumes"][-1]
        if name.startswith("TopK") and base_r:  # warm-up bytes: the dense baseline's
            warm = base_r["volumes"][1]
        row = {"optimizer": name, "world": args.world, "steps": args.steps, "first_loss": r["losses"][0],
               "last20_loss": last20, "vs_baseline": vs, "baseline": base, "warm_bytes_per_step": warm,
               "last_bytes_per_step": last, "bytes_ratio": last / warm if warm else None,
               "s_per_step": r["s_per_step"]}
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            ratio = f"1/{warm / last:.1f}" if last else "local"
            print(f"{name:<12}{r['losses'][0]:>8.3f}{last20:>9.3f}{vs:>9.3f}{warm:>14,}{last:>14,}{ratio:>8}"
                  f"{r['s_per_step']:>8.3f}", flush=True)


if __name__ == "__main__":
    main()
