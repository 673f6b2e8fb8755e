"""``zerospeed report memory``: the memory timeline of one training step of the bundled GPT, per rank.

Forks ``--world-size`` Gloo ranks (``zerospeed.testing.run_distributed``), builds ``GPT(preset)`` under a
ZeRO config (``--stage`` and an optional ``--config`` ds_config JSON whose keys win), trains ``--steps``
steps and records the last one with :class:`zerospeed.profiling.memory_timeline.MemoryTimeline`: per
phase, the measured peak (RSS on CPU) and the accounted bytes by owner, and how much of the measured
peak the accounting explains.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from zerospeed.launcher.command import UsageError


def gpt2s() -> Any:
    """The GPT-2-small shape (124M parameters, tied head): 12 layers, 768 wide, 12 heads, vocab 50257, seq 512."""
    from zerospeed.models import GPTConfig

    return GPTConfig(vocab_size=50257, block_size=512, n_layer=12, n_head=12, n_embd=768)


def presets() -> dict[str, Any]:
    from zerospeed.models import PRESETS

    return {**PRESETS, "gpt2s": gpt2s}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("memory (zerospeed report memory)")
    g.add_argument("--preset", default="tiny", help="GPT preset: tiny, demo, bench or gpt2s (GPT-2-small shape)")
    g.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage")
    g.add_argument("--world_size", "--world-size", type=int, default=2, help="ranks to fork (Gloo)")
    g.add_argument("--micro_batch", "--micro-batch", type=int, default=4, help="sequences per rank per step")
    g.add_argument("--steps", type=int, default=2, help="steps to train; the last one is recorded")
    g.add_argument("--config", default=None, help="a ds_config JSON file whose keys override the defaults")


def config_for(args: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": args.stage},
    }
    if args.config:
        try:
            with open(args.config, encoding="utf-8") as f:
                user = json.load(f)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--config {args.config!r}: {exc}") from None
        zero = {**cfg["zero_optimization"], **user.get("zero_optimization", {})}
        cfg.update(user)
        cfg["zero_optimization"] = zero
    return cfg


def _rank(preset: str, config: dict[str, Any], steps: int) -> dict[str, Any]:
    import torch

    import zerospeed
    from zerospeed.models import GPT
    from zerospeed.profiling.memory_timeline import MemoryTimeline

    cfg = presets()[preset]()
    model = GPT(cfg, seed=0)
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    micro = config["train_micro_batch_size_per_gpu"]
    gen = torch.Generator().manual_seed(engine.global_rank)
    timeline = MemoryTimeline(engine)
    for i in range(steps):
        x = torch.randint(0, min(cfg.vocab_size, 256), (micro, cfg.block_size), generator=gen)
        y = torch.randint(0, min(cfg.vocab_size, 256), (micro, cfg.block_size), generator=gen)

        def step() -> None:
            loss = engine(x, y)[1]  # the logits are not kept alive through backward
            engine.backward(loss)
            engine.step()

        if i == steps - 1:
            with timeline.record():
                step()
        else:
            step()
    return {"rank": engine.global_rank, "table": timeline.format_table(), **timeline.as_dict()}


def run(args: argparse.Namespace) -> int:
    from zerospeed.testing import run_distributed

    if args.preset not in presets():
        raise UsageError(f"--preset {args.preset!r}: choose one of {', '.join(sorted(presets()))}")
    if args.steps < 1 or args.world_size < 1 or args.micro_batch < 1:
        raise UsageError("--steps, --world_size and --micro_batch must be >= 1")
    results = run_distributed(_rank, args.world_size, args.preset, config_for(args), args.steps, timeout=3600.0)
    for r in results:
        table = r.pop("table")
        if args.json:
            print(json.dumps(r))
        else:
            print(f"rank {r['rank']}: {table}\n")
    return 0
