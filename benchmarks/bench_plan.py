"""``zerospeed plan`` against measurement: predicted vs measured per-rank peak memory over the start.

Each rank (forked Gloo ranks of ``zerospeed.testing``, world 2 by default) resets its peak-RSS counter,
notes its RSS, builds the model, runs ``zerospeed.initialize`` and ``--steps`` training steps on random tokens,
and reports the peak RSS above that start (``/proc/self/status`` VmHWM after ``clear_refs``). The prediction
is ``zerospeed plan``'s ``peak_over_start`` for the same config, computed before any rank starts.

    PYTHONPATH=src python benchmarks/bench_plan.py --models gpt:demo hf:gpt2-tiny --stages 0 1 2 3
    PYTHONPATH=src python benchmarks/bench_plan.py --models hf:gpt2 --micro-batch 4 --seq 256 --steps 3 --stages 0

``hf:gpt2`` is the real GPT-2-small shape (124M parameters, ``GPT2Config()`` sizes, dropout 0, built from the
config, nothing downloaded): about 4-5 GiB per rank at micro-batch 4 x seq 256, so run one stage at a time on
a small machine. Ranks keep glibc's default (dynamic) mmap threshold, as ``zerospeed plan`` assumes, whatever
``ZEROSPEED_MMAP_THRESHOLD`` says.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

MIB = 1024 * 1024


def config(stage: int, micro_batch: int, reuse: int | None = None, optimizer: str = "AdamW") -> dict[str, Any]:
    """AdamW (or SGD with momentum 0.9), DeepSpeed's defaults; ``reuse``: ``stage3_max_reuse_distance`` (None:
    DeepSpeed's 1e9)."""
    zero: dict[str, Any] = {"stage": stage}
    if reuse is not None:
        zero["stage3_max_reuse_distance"] = reuse
    params: dict[str, Any] = {"lr": 1e-4, **({"momentum": 0.9} if optimizer == "SGD" else {})}
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": optimizer, "params": params}, "zero_optimization": zero}


def build(name: str) -> tuple[Any, int]:
    """The real model of a ``--model`` name, and its vocabulary size."""
    kind, _, arg = name.partition(":")
    if kind == "gpt":
        from zerospeed.models import gpt

        cfg = getattr(gpt, arg)()
        return gpt.GPT(cfg, seed=0), cfg.vocab_size
    import transformers

    from zerospeed.profiling.plan_models import hf_gpt2_config

    cfg = hf_gpt2_config(arg)
    return transformers.GPT2LMHeadModel(cfg), cfg.vocab_size


def _trim_heap() -> None:
    """Give free glibc heap back to the OS, so growth over the start shows in RSS (no-op elsewhere)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def train_and_measure(name: str, stage: int, micro_batch: int, seq: int, steps: int,
                      timeline: bool = False, reuse: int | None = None, optimizer: str = "AdamW") -> dict[str, Any]:
    """On each rank: peak RSS over the RSS at this function's start, through build, initialize and steps.

    ``timeline``: record the last step with ``MemoryTimeline`` (what the bytes are, by phase and owner; its
    hooks cost time and may move the peak, so the peak-over-start of such a run is not the benchmark's figure).
    """
    from zerospeed.profiling.memory_timeline import MemoryTimeline

    import contextlib
    import gc
    import os

    import torch

    import zerospeed
    from zerospeed.profiling.memory import MemoryTracker

    os.environ["ZEROSPEED_MMAP_THRESHOLD"] = "0"  # glibc's default heap, what the plan models
    gc.collect()
    _trim_heap()  # the forked parent's free heap would otherwise be reused without showing in RSS
    tracker = MemoryTracker("cpu")  # resets the kernel's peak-RSS counter
    start = tracker.current_bytes()
    model, vocab = build(name)
    hf = not name.startswith("gpt:")
    marks = {"build": tracker.peak_bytes() - start}
    engine, *_ = zerospeed.initialize(model=model, config=config(stage, micro_batch, reuse, optimizer))
    marks["initialize"] = tracker.peak_bytes() - start
    gen = torch.Generator().manual_seed(0)
    recorder = MemoryTimeline(engine)
    for k in range(steps):
        x = torch.randint(0, vocab, (micro_batch, seq + 1), generator=gen)
        with recorder.record() if timeline and k == steps - 1 else contextlib.nullcontext():
            loss = engine(input_ids=x[:, :-1], labels=x[:, :-1]).loss if hf else engine(x[:, :-1], x[:, 1:])[1]
            marks[f"forward{k}"] = tracker.peak_bytes() - start
            engine.backward(loss)
            marks[f"backward{k}"] = tracker.peak_bytes() - start
            engine.step()
        marks[f"step{k}"] = tracker.peak_bytes() - start
    out = {"peak_over_start": tracker.peak_bytes() - start, "marks": marks, "accounted": engine.memory_breakdown()}
    if timeline:
        out["timeline"] = recorder.format_table()
    return out


def import_torch_rss() -> int:
    """RSS of a fresh interpreter after ``import torch, zerospeed`` (the baseline ``plan`` adds)."""
    code = "import torch, zerospeed, psutil; print(psutil.Process().memory_info().rss)"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    from zerospeed.config import load_config
    from zerospeed.profiling.plan import inputs_from_config, predict
    from zerospeed.profiling.plan_models import model_spec
    from zerospeed.testing import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt:demo", "hf:gpt2-tiny"])
    ap.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--reuse-distance", type=int, default=None,
                    help="stage3_max_reuse_distance (default: DeepSpeed's 1e9; 0 releases every gathered parameter)")
    ap.add_argument("--timeline", action="store_true", help="also record the last step's memory timeline per rank")
    ap.add_argument("--optimizer", choices=["AdamW", "SGD"], default="AdamW", help="SGD: momentum 0.9 (no step temporaries)")
    args = ap.parse_args()
    print(f"bare `import torch, zerospeed` RSS: {import_torch_rss() / MIB:.1f} MiB (the plan's baseline)")
    print(f"{'model':<16}{'stage':>6}{'predicted MiB':>15}{'measured MiB (ranks)':>24}{'error':>9}")
    for name in args.models:
        spec = model_spec(name)
        for stage in args.stages:
            cfg = load_config(config(stage, args.micro_batch, args.reuse_distance, args.optimizer))
            plan = predict(spec, inputs_from_config(cfg, args.world_size, args.micro_batch, args.seq))
            results = run_distributed(train_and_measure, args.world_size, name, stage, args.micro_batch, args.seq,
                                      args.steps, args.timeline, args.reuse_distance, args.optimizer, timeout=1800)
            measured = [r["peak_over_start"] for r in results]
            worst = max(measured, key=lambda m: abs(plan.peak_over_start - m))
            error = (plan.peak_over_start - worst) / worst
            shown = " / ".join(f"{m / MIB:.1f}" for m in measured)
            print(f"{name:<16}{stage:>6}{plan.peak_over_start / MIB:>15.1f}{shown:>24}{error:>+9.1%}", flush=True)
            for r in results if args.timeline else []:
                print(r["timeline"])
            if args.json:
                print(json.dumps({"model": name, "stage": stage, "micro_batch": args.micro_batch, "seq": args.seq,
                                  "reuse_distance": args.reuse_distance, "steps": args.steps, "optimizer": args.optimizer,
                                  "predicted": plan.peak_over_start, "measured": measured, "worst_error": error,
                                  "owners": plan.owners, "marks": [r["marks"] for r in results]}), flush=True)


if __name__ == "__main__":
    main()
