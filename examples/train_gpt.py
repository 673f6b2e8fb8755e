"""Train the bundled byte-level GPT on the bundled corpus with zerospeed — the `make demo` script.

    zerospeed launch --nproc-per-node 2 examples/train_gpt.py --config examples/configs/demo_zero2.json

It is the DeepSpeed training loop unchanged: ``initialize`` returns an engine; each micro-batch is
``loss = engine(x, y)``, ``engine.backward(loss)``, ``engine.step()`` (the engine accumulates gradients and
steps the optimizer only at the accumulation boundary). ``--steps`` counts optimizer steps. Rank 0 shows a
progress bar; at the end every rank reports its memory, rank 0 prints a summary and a text sampled from the
trained model, and ``--out`` receives the checkpoint, the loss curve (PNG) and the TensorBoard logs.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import zerospeed
from zerospeed import comm
from zerospeed.data import ByteDataset
from zerospeed.models import GPT, PRESETS
from zerospeed.profiling._device import device_name
from zerospeed.profiling.flops_profiler import get_model_profile
from zerospeed.profiling.flops_profiler.peaks import mfu
from zerospeed.profiling.plot import write_curve_png

MiB = 1024 * 1024


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="DeepSpeed-style JSON config (ds_config.json)")
    p.add_argument("--steps", type=int, default=240, help="optimizer steps (the demo configs' schedules span 240)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="demo", help="model size")
    p.add_argument("--seed", type=int, default=0, help="model init and data order seed")
    p.add_argument("--eval-batches", type=int, default=16, help="validation micro-batches, split over ranks")
    p.add_argument("--out", default="runs/demo", help="where the checkpoint, loss curve and TensorBoard logs go")
    p.add_argument("--sample-bytes", type=int, default=240, help="length of the text sampled at the end")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step is warm-up and is not timed)")
    return args


def endless(loader: Any) -> Iterator[Any]:
    """Cycle over the loader forever, reshuffling each epoch when its sampler supports it."""
    epoch = 0
    while True:
        sampler = getattr(loader, "sampler", None) or getattr(loader, "data_sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def train(engine: Any, batches: Iterator[Any], steps: int, tokens_per_step: int) -> tuple[list[float], float]:
    """Run ``steps`` optimizer steps; returns each step's local mean loss and the seconds after step 1."""
    gas = engine.gradient_accumulation_steps()
    losses: list[float] = []
    bar = tqdm(total=steps, desc="train", unit="step", disable=comm.get_rank() != 0, dynamic_ncols=True)
    t_after_first = 0.0
    for step in range(steps):
        total = 0.0
        for _ in range(gas):
            x, y = (t.to(engine.device) for t in next(batches))
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / gas)
        if step == 0:
            t_after_first = time.perf_counter()  # step 1 pays for warm-up; rates are measured after it
        else:
            rate = step * tokens_per_step / (time.perf_counter() - t_after_first)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{engine.get_lr()[0]:.2e}", tok_s=f"{rate:,.0f}")
        bar.update(1)
    bar.close()
    return losses, time.perf_counter() - t_after_first


@torch.no_grad()
def evaluate(engine: Any, block_size: int, micro_batch: int, batches: int) -> float:
    """Mean validation loss over ``batches`` fixed micro-batches, shared out round-robin over ranks."""
    val = ByteDataset(block_size, "val")
    rank, world = comm.get_rank(), comm.get_world_size()
    engine.eval()
    totals = torch.zeros(2, device=engine.device)  # collectives need tensors on the engine's device (NCCL)
    for b in range(rank, batches, world):
        idx = [(b * micro_batch + i) % len(val) for i in range(micro_batch)]
        x = torch.stack([val[i][0] for i in idx]).to(engine.device)
        y = torch.stack([val[i][1] for i in idx]).to(engine.device)
        _, loss = engine(x, y)
        totals[0] += loss.detach().float()
        totals[1] += 1
    engine.train()
    comm.all_reduce(totals)
    return (totals[0] / totals[1]).item()


@torch.no_grad()
def sample(engine: Any, block_size: int, length: int, prompt: str = "The ", temperature: float = 0.8,
           seed: int = 0) -> str:
    """Text sampled byte by byte from the trained model. Every rank samples the same text in step (under
    ZeRO-3 each forward gathers parameters collectively); the caller prints rank 0's."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt.encode())], dtype=torch.long, device=engine.device)
    engine.eval()
    for _ in range(length):
        logits, _ = engine.module(idx[:, -block_size:])
        probs = torch.softmax(logits[0, -1].float().cpu() / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen).to(engine.device)
        idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
    engine.train()
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


def with_tensorboard(config_path: str, out: Path) -> dict[str, Any]:
    """The config, with TensorBoard logs under ``out`` unless the config says otherwise."""
    config = json.loads(Path(config_path).read_text())
    config.setdefault("tensorboard", {"enabled": True, "output_path": str(out / "tensorboard"), "job_name": "demo"})
    return config


def memory_line(engine: Any) -> str:
    """This rank's peak RSS and, when the engine counts them, the bytes of model state it holds."""
    line = f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"  # Linux: KiB
    if hasattr(engine, "memory_breakdown"):
        parts = {k: v / MiB for k, v in engine.memory_breakdown().items() if isinstance(v, (int, float))}
        total = parts.pop("total", sum(parts.values()))
        parts.pop("model_states", None)
        line += f" | model state {total:.1f} MiB (" + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) + ")"
    return line


def forward_flops(model: GPT, micro: int, block_size: int, device: torch.device) -> float:
    """FLOPs of one micro-batch forward, counted by zerospeed's flops profiler (no hooks left behind)."""
    x = torch.zeros(micro, block_size, dtype=torch.long, device=device)
    flops, _, _ = get_model_profile(model, args=[x, x], print_profile=False, as_string=False, warm_up=0)
    return float(flops)


def mfu_line(step_flops: float, s_per_step: float, world: int) -> str:
    achieved = step_flops / s_per_step
    name = device_name()
    util = mfu(achieved / world, name)
    util_text = f"{util * 100:.1f}%" if util is not None else f"n/a (no known peak FLOP/s for '{name}')"
    return (f"model FLOPs: {step_flops / 1e9:.2f} GFLOP/step (3 x forward) | achieved {achieved / 1e9:.2f} GFLOP/s "
            f"global, {achieved / world / 1e9:.2f} per rank | MFU {util_text}")


def main() -> None:
    args = parse_args()
    zerospeed.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    cfg = PRESETS[args.preset]()
    model = GPT(cfg, seed=args.seed)
    dataset = ByteDataset(cfg.block_size, "train")
    out = Path(args.out)
    config = with_tensorboard(args.config, out)
    engine, _, loader, _ = zerospeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, training_data=dataset
    )
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    tokens_per_step = micro * gas * world * cfg.block_size
    step_flops = 3 * forward_flops(model, micro, cfg.block_size, engine.device) * gas * world
    if rank == 0:
        print(
            f"GPT[{args.preset}] {model.num_params() / 1e6:.2f}M params | world {world} | micro {micro} x gas {gas}"
            f" x seq {cfg.block_size} = {tokens_per_step:,} tokens/step | {args.steps} steps | config {args.config}"
        )
    t0 = time.perf_counter()
    losses, timed = train(engine, endless(loader), args.steps, tokens_per_step)
    wall = time.perf_counter() - t0
    val_loss = evaluate(engine, cfg.block_size, micro, args.eval_batches)
    last = min(10, len(losses))
    ends = torch.tensor([losses[0], sum(losses[-last:]) / last], device=engine.device)
    comm.all_reduce(ends)  # mean over ranks
    first, final = (ends / world).tolist()
    curve = torch.tensor(losses, device=engine.device)
    comm.all_reduce(curve)
    engine.save_checkpoint(str(out / "checkpoint"), overwrite=True)  # a rerun of the demo replaces its own last one
    text = sample(engine, cfg.block_size, args.sample_bytes, seed=args.seed)
    mem = comm.all_gather_object(memory_line(engine))
    if rank == 0:
        s_per_step = timed / (args.steps - 1)
        tok_s = tokens_per_step / s_per_step
        print(f"\nloss: first {first:.3f} (ln 256 = {math.log(256):.3f}) -> last {final:.3f} (last {last} steps)")
        print(f"val loss: {val_loss:.3f} ({val_loss / math.log(2):.2f} bits/byte)")
        print(f"time: {wall:.1f} s, {s_per_step:.3f} s/step, {tok_s:,.0f} tokens/s (global; steps after the first)")
        print(mfu_line(step_flops, s_per_step, world))
        for r, line in enumerate(mem):
            print(f"memory rank {r}: {line}")
        summary = {"first_loss": first, "last_loss": final, "val_loss": val_loss, "s_per_step": s_per_step,
                   "tokens_per_s": tok_s}
        print("summary " + json.dumps({k: round(v, 4) for k, v in summary.items()}))
        write_curve_png(out / "loss.png", (curve / world).tolist())
        tb = config["tensorboard"]
        print(f"\nsample (temperature 0.8, prompt 'The '):\n{text}\n")
        print(f"checkpoint: {out / 'checkpoint'} | loss curve: {out / 'loss.png'}"
              + (f" | TensorBoard: tensorboard --logdir {tb['output_path']}" if tb.get("enabled") else ""))
    comm.barrier()  # leave together: a rank tearing down Gloo while its peer still talks can abort the peer
    comm.destroy()


if __name__ == "__main__":
    main()
