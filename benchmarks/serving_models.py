"""Trained byte-level GPTs for the speculative-decoding benchmark: a target and a draft of the same vocabulary.

    .venv/bin/python benchmarks/serving_models.py --shape 6x256 --steps 1500     # train (or load) one, print loss

A shape is ``LAYERSxWIDTH`` (zerospeed GPT, 4 heads, bytes, 1024 positions). Training: batches of 16 x 128 bytes
from the first 90 % of the bundled corpus, AdamW at 3e-3 with a cosine decay to 3e-4, seed 0. A trained model is
kept in ``$ZS_BENCH_CACHE`` (default ``/tmp/zs_bench_models``) as a state dict keyed by shape and steps, so
paired benchmark runs reuse one pair instead of retraining it (the training takes minutes on this CPU).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch

__all__ = ["corpus_model", "parse_shape", "val_loss"]


def parse_shape(shape: str) -> tuple[int, int]:
    """``"6x256"`` -> ``(6, 256)``."""
    layers, width = shape.lower().split("x")
    return int(layers), int(width)


def _data() -> torch.Tensor:
    from zerospeed.data import load_corpus

    return torch.frombuffer(bytearray(load_corpus()), dtype=torch.uint8).long()


def _new(shape: str) -> torch.nn.Module:
    from zerospeed.models.gpt import GPT, GPTConfig

    layers, width = parse_shape(shape)
    return GPT(GPTConfig(block_size=1024, n_layer=layers, n_head=4, n_embd=width), seed=0)


@torch.no_grad()
def val_loss(model: torch.nn.Module, batches: int = 8) -> float:
    """Mean next-byte loss (nats) on windows from the last 10 % of the corpus (fixed seed)."""
    data = _data()
    split = int(0.9 * data.numel())
    g = torch.Generator().manual_seed(1)
    at = torch.randint(split, data.numel() - 129, (batches * 16,), generator=g).tolist()
    losses = [model(x[:, :-1], x[:, 1:])[1].item()
              for x in (torch.stack([data[i:i + 129] for i in at[b * 16:(b + 1) * 16]]) for b in range(batches))]
    return sum(losses) / len(losses)


def train(shape: str, steps: int) -> torch.nn.Module:
    data = _data()
    split = int(0.9 * data.numel())
    model = _new(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 3e-4 + 0.5 * (3e-3 - 3e-4) * (1 + math.cos(math.pi * step / steps))
        at = torch.randint(0, split - 129, (16,), generator=g)
        x = torch.stack([data[i:i + 129] for i in at.tolist()])
        loss = model(x[:, :-1], x[:, 1:])[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 100 == 0:
            print(f"# {shape} step {step + 1}/{steps}: loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    return model


def corpus_model(shape: str, steps: int) -> torch.nn.Module:
    """The ``shape`` GPT trained ``steps`` steps on the corpus, from the cache when it holds one (eval mode)."""
    path = Path(os.environ.get("ZS_BENCH_CACHE", "/tmp/zs_bench_models")) / f"gpt_{shape}_{steps}.pt"
    if path.exists():
        model = _new(shape)
        model.load_state_dict(torch.load(path, weights_only=True))
    else:
        model = train(shape, steps)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(model.state_dict(), tmp)
        tmp.replace(path)
    model.eval()
    print(f"# {shape} GPT, {steps} training steps on the corpus: validation loss {val_loss(model):.3f} nats/byte")
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="6x256")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    corpus_model(args.shape, args.steps)


if __name__ == "__main__":
    main()
