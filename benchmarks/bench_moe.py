"""Mixture of Experts: zerospeed's MoE at ep=1 and ep=2 vs DeepSpeed's MoE, same model and data, same run.

Contenders (each in its own forked Gloo ranks at world 2, ZeRO-2, AdamW, fp32): zerospeed ep=1 (experts
replicated, reduced over the data-parallel group), zerospeed ep=2 (experts split, tokens moved by two
all-to-alls per MoE layer), and DeepSpeed's ``deepspeed.moe.layer.MoE`` at ep=2 when ``deepspeed`` is
importable (run with its venv: ``DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python benchmarks/bench_moe.py``).
Model: a GPT whose every MLP is an MoE layer (top-k gating, no noise, no random token selection).
Reported: median wall and CPU seconds per step (max over ranks), tokens per second, expert parameters
held per rank (counted), all-to-all bytes sent per step per rank (zerospeed's comms logger: measured),
peak RSS, last loss.

    python benchmarks/bench_moe.py [--experts 8] [--k 1] [--steps 5] [--json]
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
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zerospeed.models.gpt import GPT, MLP, GPTConfig  # noqa: E402
from zerospeed.profiling.memory import peak_rss_bytes  # noqa: E402
from zerospeed.testing import run_distributed  # noqa: E402

MiB = 1024 * 1024


class MoEMLP(nn.Module):
    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.moe = moe
        self.l_aux: Any = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, self.l_aux, _ = self.moe(x)
        return y


class MoEGPT(nn.Module):
    def __init__(self, moe_cls: Any, cfg: GPTConfig, experts: int, ep: int, k: int) -> None:
        super().__init__()
        self.gpt = GPT(cfg)
        for block in self.gpt.blocks:
            block.mlp = MoEMLP(moe_cls(cfg.n_embd, MLP(cfg), experts, ep, k, capacity_factor=1.25, min_capacity=4,
                                       use_rts=False, top2_2nd_expert_sampling=False))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _, loss = self.gpt(idx, targets)
        return loss + 0.01 * sum(b.mlp.l_aux for b in self.gpt.blocks)


def _rank(framework: str, ep: int, cfg: GPTConfig, experts: int, k: int, micro: int, warmup: int, steps: int,
          clip: float) -> dict:
    torch.manual_seed(0)
    # weight_decay explicit: DeepSpeed's torch_adam path would take torch AdamW's default 0.01 (FusedAdam's is 0)
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "gradient_clipping": clip, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}}
    if framework == "deepspeed":
        import warnings

        import deepspeed
        import deepspeed.ops
        from deepspeed.moe.layer import MoE

        warnings.filterwarnings("ignore")
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        config["optimizer"]["params"]["torch_adam"] = True
        deepspeed.init_distributed(dist_backend="gloo")
        init = deepspeed.initialize
    else:
        import zerospeed
        from zerospeed.moe.layer import MoE

        init = zerospeed.initialize
    from zerospeed import comm
    from zerospeed.moe.utils import is_moe_param

    model = MoEGPT(MoE, cfg, experts, ep, k)
    engine, *_ = init(model=model, model_parameters=list(model.parameters()), config=config)
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(100 + rank)
    data = torch.randint(0, cfg.vocab_size, (warmup + steps, micro, cfg.block_size + 1), generator=g)
    times, cpu, a2a, losses = [], [], [], []
    for s in range(warmup + steps):
        comm.COMMS_LOGGER.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        out = engine(data[s, :, :-1], data[s, :, 1:])
        engine.backward(out)
        engine.step()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            st = comm.COMMS_LOGGER.snapshot().get("all_to_all_single")
            a2a.append(st.bytes if st is not None else 0)
        losses.append(float(out.detach()))
    expert_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if is_moe_param(p))
    return {"times": times, "cpu": cpu, "a2a": a2a, "rss": peak_rss_bytes(), "loss": losses[-1], "losses": losses,
            "expert_bytes": expert_bytes}


def run(framework: str, ep: int, cfg: GPTConfig, experts: int, k: int, micro: int, warmup: int, steps: int,
        clip: float) -> dict:
    ranks = run_distributed(_rank, 2, framework, ep, cfg, experts, k, micro, warmup, steps, clip, timeout=3600)
    per_step = [max(r["times"][i] for r in ranks) for i in range(steps)]
    per_cpu = [max(r["cpu"][i] for r in ranks) for i in range(steps)]
    s = statistics.median(per_step)
    a2a = [r["a2a"] for r in ranks]
    return {"contender": f"{framework} ep={ep}", "s_per_step": s, "cpu_s_per_step": statistics.median(per_cpu),
            "tokens_per_s": 2 * micro * cfg.block_size / s, "expert_mib_per_rank": ranks[0]["expert_bytes"] / MiB,
            "a2a_mib_per_step_rank": (statistics.median(a2a[0]) / MiB) if framework == "zerospeed" else None,
            "peak_rss_mib": max(r["rss"] for r in ranks) / MiB, "loss": ranks[0]["loss"],
            "losses_rank0": ranks[0]["losses"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (0: off)")
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument("--deepspeed-ep", type=int, nargs="+", default=[2], help="DeepSpeed contenders' ep sizes")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    cfg = GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=args.n_embd)
    contenders = [("zerospeed", 1), ("zerospeed", 2)]
    if not args.no_deepspeed:
        try:
            import deepspeed  # noqa: F401
            contenders += [("deepspeed", ep) for ep in args.deepspeed_ep]
        except ImportError:
            pass
    results = [run(f, ep, cfg, args.experts, args.k, args.micro, args.warmup, args.steps, args.clip)
               for f, ep in contenders]
    if args.json:
        for r in results:
            print(json.dumps({"bench": "moe", "experts": args.experts, "k": args.k, **r}))
        return 0
    print(f"MoE GPT {cfg.n_layer}x{cfg.n_embd}, {args.experts} experts, top-{args.k}, seq {cfg.block_size}, "
          f"micro-batch {args.micro}, world 2, ZeRO-2, fp32")
    print(f"{'contender':<18}{'s/step':>9}{'cpu s':>9}{'tok/s':>9}{'expert MiB':>12}{'a2a MiB':>10}{'RSS MiB':>10}"
          f"{'loss':>9}")
    for r in results:
        a2a = f"{r['a2a_mib_per_step_rank']:.2f}" if r["a2a_mib_per_step_rank"] is not None else "-"
        print(f"{r['contender']:<18}{r['s_per_step']:>9.3f}{r['cpu_s_per_step']:>9.3f}{r['tokens_per_s']:>9.0f}"
              f"{r['expert_mib_per_rank']:>12.2f}{a2a:>10}{r['peak_rss_mib']:>10.0f}{r['loss']:>9.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
