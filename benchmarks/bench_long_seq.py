"""Longest sequence a fixed GPT trains on at world 2 within a per-rank memory budget (measured peak RSS).

Modes, all at world 2, ZeRO stage 2, fp32, one sequence per data-parallel rank per step:

* ``dp``        plain data parallelism: each rank trains its own whole sequence;
* ``dp+tiled``  the same with TiledMLP, tiled logits + loss, and checkpointed blocks with ``cpu_checkpointing``;
* ``sp2``       Ulysses sequence parallelism (``sequence_parallel_size: 2``): each rank holds half of one sequence;
* ``sp2+tiled`` Ulysses + TiledMLP + tiled logits/loss + checkpointed blocks with ``cpu_checkpointing``.

A *probe* forks two Gloo ranks that each reset their peak-RSS counter (``/proc/self/clear_refs``), build the
model and engine, and train ``steps`` steps on random tokens at sequence length L; a rank's memory is its
peak resident set over all of that minus its RSS when it started (model, optimizer state, buffers and
activations: what a device would have to hold). glibc is told to ``mmap`` every allocation over 64 KiB
(``mallopt``), in every mode alike, so freed tensors leave the resident set and the peak follows live bytes.
The search per mode: probe two lengths, fit memory = a + b*L, probe the predicted longest length that fits and
correct by the secant until the longest fitting probe is within ``--tolerance`` of the first failing one.
Tokens/s is global tokens over the wall time of the last step (a loaded machine: compare within one run).

On a CPU-only machine ``cpu_checkpointing`` moves nothing (activations already live in host memory); the
tiled rows' saving comes from tiling and checkpointing. On an accelerator the same flag moves each block's
held input to host memory.

    PYTHONPATH=src python benchmarks/bench_long_seq.py --budget-mib 256 [--modes dp,sp2+tiled] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

MiB = 1024 * 1024
MODES = ("dp", "dp+tiled", "sp2", "sp2+tiled")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MLP_SHARD_TOKENS, LOSS_SHARD_TOKENS = 256, 256  # tokens per tile (per rank's local sequence)


@dataclass(frozen=True)
class Model:
    """The fixed GPT (``block_size`` bounds the longest sequence probed; it is part of the model)."""

    vocab_size: int = 8192
    block_size: int = 16384
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128


@dataclass
class Probe:
    mode: str
    seq_len: int
    peak_mib: float  # max over ranks: peak RSS minus the rank's RSS at its start
    start_mib: float  # RSS a rank had when it started (interpreter + torch, shared with the parent)
    tokens_per_s: float
    step_s: float
    loss: float
    fits: bool = False


class _Checkpointed(nn.Module):
    """A block run under ``zerospeed.checkpointing.checkpoint`` (its input kept, the rest recomputed)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from zerospeed import checkpointing

        return checkpointing.checkpoint(self.block, x)


def _rank(model_cfg: Model, mode: str, seq_len: int, steps: int, threads: int) -> dict[str, Any]:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    libc.mallopt(M_TRIM_THRESHOLD, 64 * 1024)
    from zerospeed.profiling.memory import measure_memory

    torch.set_num_threads(threads)
    with measure_memory() as mem:
        out = _train(model_cfg, mode, seq_len, steps)
    out.update(peak=mem.growth_bytes, start=mem.start_bytes)
    return out


def _train(model_cfg: Model, mode: str, seq_len: int, steps: int) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm
    from zerospeed.models.gpt import GPT, GPTConfig
    from zerospeed.parallel.sequence.gpt import sequence_parallel_gpt

    sp = 2 if mode.startswith("sp2") else 1
    tiled = mode.endswith("+tiled")
    local = seq_len // sp
    cfg = GPTConfig(**asdict(model_cfg), tiled_mlp_shards=max(1, math.ceil(local / MLP_SHARD_TOKENS)) if tiled else 1,
                    tiled_loss_shards=max(1, math.ceil(local / LOSS_SHARD_TOKENS)) if tiled else 1)
    model = GPT(cfg, seed=0)
    if tiled:
        model.blocks = nn.ModuleList(_Checkpointed(b) for b in model.blocks)
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                              "sequence_parallel_size": sp, "zero_optimization": {"stage": 2},
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if tiled:
        config["activation_checkpointing"] = {"cpu_checkpointing": True}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    if sp > 1:
        sequence_parallel_gpt(model, engine.seq_parallel_group)
    rank = comm.get_rank()
    step_s, loss = 0.0, float("nan")
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + (rank if sp == 1 else 0))
        tokens = torch.randint(model_cfg.vocab_size, (1, seq_len + 1), generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        cols = slice(rank * local, (rank + 1) * local) if sp > 1 else slice(0, seq_len)
        comm.barrier()
        t0 = time.perf_counter()
        out = engine(x[:, cols], y[:, cols], position_ids=torch.arange(seq_len)[cols])[1]  # logits not kept
        engine.backward(out)
        engine.step()
        step_s = time.perf_counter() - t0
        loss = out.item()
    return {"step_s": step_s, "loss": loss, "tokens": seq_len * (2 // sp)}


def probe(model_cfg: Model, mode: str, seq_len: int, steps: int, threads: int, timeout: float) -> Probe:
    from zerospeed.testing import run_distributed

    results = run_distributed(_rank, 2, model_cfg, mode, seq_len, steps, threads, timeout=timeout)
    step_s = max(r["step_s"] for r in results)
    return Probe(mode, seq_len, max(r["peak"] for r in results) / MiB, max(r["start"] for r in results) / MiB,
                 results[0]["tokens"] / step_s, step_s, results[0]["loss"])


def longest(model_cfg: Model, mode: str, budget_mib: float, args: argparse.Namespace
            ) -> tuple[Probe | None, list[Probe]]:
    """Longest probed length (a multiple of ``--grain``) whose measured peak fits the budget."""
    grain = args.grain
    probes: list[Probe] = []

    def run(n: int) -> Probe:
        n = max(grain, min(args.max_len or model_cfg.block_size, model_cfg.block_size, n // grain * grain))
        for p in probes:
            if p.seq_len == n:
                return p
        p = probe(model_cfg, mode, n, args.steps, args.threads, args.timeout)
        p.fits = p.peak_mib <= budget_mib
        probes.append(p)
        print(f"  {mode:10s} L={n:6d}  peak {p.peak_mib:7.1f} MiB  {'fits' if p.fits else 'over'}  "
              f"{p.tokens_per_s:8.0f} tok/s  ({p.step_s:.1f} s/step)", flush=True)
        return p

    run(args.start)
    run(2 * args.start)
    for _ in range(args.max_probes):
        fits = sorted((p for p in probes if p.fits), key=lambda p: p.seq_len)
        over = sorted((p for p in probes if not p.fits), key=lambda p: p.seq_len)
        lo, hi = (fits[-1] if fits else None), (over[0] if over else None)
        if lo is not None and hi is not None and hi.seq_len - lo.seq_len <= max(grain, args.tolerance * lo.seq_len):
            break
        if lo is not None and lo.seq_len >= min(args.max_len or model_cfg.block_size, model_cfg.block_size):
            break  # fits at the cap: reported as ">= cap"
        if lo is None:  # nothing fits yet
            guess = hi.seq_len / 2  # type: ignore[union-attr]
        else:  # secant towards the budget: between lo and hi, or through the two longest that fit
            ref = hi if hi is not None else (fits[-2] if len(fits) > 1 else None)
            slope = (lo.peak_mib - ref.peak_mib) / (lo.seq_len - ref.seq_len) if ref is not None else 0.0
            guess = lo.seq_len + (budget_mib - lo.peak_mib) / slope if slope > 0 else 4 * lo.seq_len
            guess = min(guess, 4 * lo.seq_len)  # one probe never runs for ages
            if hi is not None:
                guess = min(max(guess, lo.seq_len + grain), hi.seq_len - grain)
        n = max(grain, int(guess) // grain * grain)
        if any(p.seq_len == n for p in probes):
            if lo is None or any(p.seq_len == lo.seq_len + grain for p in probes):
                break
            n = lo.seq_len + grain
        run(n)
    good = [p for p in probes if p.fits]
    return (max(good, key=lambda p: p.seq_len) if good else None), probes


def _extrapolated(probes: list[Probe], budget_mib: float) -> str:
    """Where the line through the two longest probes meets the budget (an estimate, not a measurement)."""
    top = sorted(probes, key=lambda p: p.seq_len)[-2:]
    if len(top) < 2 or top[1].peak_mib <= top[0].peak_mib:
        return "-"
    slope = (top[1].peak_mib - top[0].peak_mib) / (top[1].seq_len - top[0].seq_len)
    return f"~{int(top[1].seq_len + (budget_mib - top[1].peak_mib) / slope)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mib", type=float, default=256.0, help="per-rank peak RSS growth budget")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=2, help="steps per probe (the last is timed)")
    parser.add_argument("--start", type=int, default=512, help="first probe length (then twice it)")
    parser.add_argument("--grain", type=int, default=128)
    parser.add_argument("--tolerance", type=float, default=0.1)
    parser.add_argument("--max-probes", type=int, default=5)
    parser.add_argument("--max-len", type=int, default=8192,
                        help="longest length probed (CPU time grows as L^2 through attention); 0: block_size")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model_cfg = Model()
    rows = []
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        best, probes = longest(model_cfg, mode, args.budget_mib, args)
        rows.append((mode, best, probes))
    base = next((b.seq_len for m, b, _ in rows if m == "dp" and b is not None), None)
    print(f"\nGPT {asdict(model_cfg)}, world 2, ZeRO 2, fp32; budget {args.budget_mib:.0f} MiB per rank "
          "(peak RSS growth, measured)")
    print("| mode | longest sequence (measured) | x plain DP | peak MiB/rank | tokens/s | probes | extrapolated |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, best, probes in rows:
        if best is None:
            print(f"| {mode} | none fits | | | | {len(probes)} |")
            continue
        ratio = f"{best.seq_len / base:.1f}x" if base else "-"
        capped = best.seq_len >= min(args.max_len or model_cfg.block_size, model_cfg.block_size)
        length = f">= {best.seq_len} (cap)" if capped else str(best.seq_len)
        ratio = (">= " if capped else "") + ratio
        print(f"| {mode} | {length} | {ratio} | {best.peak_mib:.0f} | {best.tokens_per_s:.0f} | {len(probes)} | "
              f"{_extrapolated(probes, args.budget_mib)} |")
        if args.json:
            print(json.dumps({"mode": mode, "best": asdict(best), "probes": [asdict(p) for p in probes]}))


if __name__ == "__main__":
    main()
