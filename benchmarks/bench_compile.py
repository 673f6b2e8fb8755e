"""engine.compile() vs eager: step time of the demo GPT under ZeRO 0 and 3, world 2, compile time apart.

    .venv/bin/python benchmarks/bench_compile.py [--preset demo] [--micro-batch 8] [--steps 5] [--repeat 1]
        [--stages 0 3] [--backend inductor] [--deepcompile] [--fsdp2] [--free-activation] [--no-plain]
        [--max-reuse N] [--device cpu|cuda] [--json]

``--device cuda`` (``scripts/gpu-check``): NCCL, one rank per device (at most 2; one GPU runs world 1), and
"peak dev GiB" is each rank's ``torch.cuda.max_memory_allocated``.

``--deepcompile`` adds a third mode at stages 1-3: ``compile.deepcompile: true`` (ZeRO inside the graph,
docs/compile.md) with the same backend (``--free-activation``: with ``compile.free_activation``, threshold 0).
``--fsdp2`` adds, at stage 3, torch's FSDP2 (``fully_shard`` per block and the root) compiled with
``torch.compile`` and the same backend, same AdamW, clipping and batches. "peak RSS" is each rank's
``ru_maxrss`` over the whole run, compilation included; "steady RSS" the peak over the steps after the first
(``VmHWM`` reset after step 1: training memory without the compiler's); GiB, mean of the ranks. "comm
MB/step" the bytes the engine's collectives moved in the last step (not counted for FSDP2); "colls/step" the
``torch.distributed`` calls of the last step (collectives and point-to-point sends/receives, every mode,
counted at ``torch.distributed``: on Gloo zerospeed's all-gather is one ``broadcast`` per rank and a
world-2 reduce-scatter one send/receive pair, each counted).

Each (stage, mode) run is its own pair of forked Gloo ranks with the same model, seed and batches; eager
and compiled runs alternate. "first step" is the first step's wall time (tracing and code generation
included, with an empty inductor cache per compiled run); "compile" is that minus the eager run's mean
step; the steady figures are means over ``--steps`` later steps (wall and CPU seconds per rank). "graphs"
and "breaks" are dynamo's counts for the run: stage 3's gather/release hooks are deliberate graph breaks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

import zerospeed
from zerospeed.models import GPT, PRESETS
from zerospeed.testing import run_distributed


_COLLECTIVES = ("all_gather_into_tensor", "all_gather", "all_gather_single", "reduce_scatter_tensor",
                "reduce_scatter", "reduce_scatter_single", "all_reduce", "reduce", "broadcast", "all_to_all_single",
                "isend", "irecv")


def _count_collectives() -> list[int]:
    """Count every call of torch.distributed's collectives from now on (this rank); returns the counter."""
    import torch.distributed as dist

    calls = [0]
    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def counted(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            calls[0] += 1
            return _fn(*args, **kwargs)

        setattr(dist, name, counted)
    return calls


def _vm_hwm_gib(reset: bool = False) -> float:
    """This process's peak RSS since the last reset (``/proc/self/status`` VmHWM); ``reset``: start again."""
    import re

    with open("/proc/self/status") as f:
        peak = int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 2 ** 20  # type: ignore[union-attr]
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return peak


class _Fsdp2:
    """FSDP2 + torch.compile with the engine's interface the loop below uses (forward, backward, step)."""

    def __init__(self, model: torch.nn.Module, backend: str) -> None:
        from torch.distributed.fsdp import fully_shard

        import torch.distributed as dist

        if torch.cuda.is_available() and dist.get_backend() == "nccl":
            model.cuda()

        for block in model.blocks:  # type: ignore[attr-defined]
            fully_shard(block)
        fully_shard(model)
        model.compile(backend=backend)
        self.model, self.global_rank, self.last_step_comm_volume = model, dist.get_rank(), 0
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        return self.model(x, y)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _rank(preset: str, micro_batch: int, steps: int, stage: int, backend: str | None,
          deep: bool = False, max_reuse: int | None = None, fsdp2: bool = False,
          free_activation: bool = False) -> dict[str, Any]:
    import resource

    from zerospeed.runtime.compile import compiled_graph_count

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = PRESETS[preset]()
    model = GPT(cfg, seed=0)
    engine: Any
    if fsdp2:
        engine = _Fsdp2(model, backend or "inductor")
    else:
        config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_clipping": 1.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage},
                  "compile": {"deepcompile": deep}}
        if deep and free_activation:
            config["compile"].update(free_activation=True, free_activation_threshold=0)
        if max_reuse is not None:  # stage 3: what stays gathered from forward to backward (eager and DeepCompile)
            config["zero_optimization"]["stage3_max_reuse_distance"] = max_reuse
        engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        if backend is not None:
            engine.compile(backend=backend)
    calls = _count_collectives()
    gen = torch.Generator().manual_seed(engine.global_rank)
    cuda = torch.cuda.is_available() and torch.distributed.get_backend() == "nccl"
    batches = [torch.randint(0, cfg.vocab_size, (micro_batch, cfg.block_size + 1), generator=gen)
               for _ in range(steps + 1)]
    if cuda:
        batches = [b.cuda() for b in batches]
        torch.cuda.reset_peak_memory_stats()
    walls, cpus, losses = [], [], []
    for i, b in enumerate(batches):
        calls[0] = 0
        w0, c0 = time.perf_counter(), time.process_time()
        _, loss = engine(b[:, :-1], b[:, 1:])
        engine.backward(loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        losses.append(float(loss.detach()))
        if i == 0:
            _vm_hwm_gib(reset=True)
    counts = compiled_graph_count() if backend is not None else {"graphs": 0, "graph_breaks": 0}
    return {"first_s": walls[0], "wall_s": sum(walls[1:]) / steps, "cpu_s": sum(cpus[1:]) / steps,
            "losses": losses, "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
            "steady_gib": _vm_hwm_gib(), "dev_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0,
            "colls": calls[0], "comm_mb": engine.last_step_comm_volume / 1e6, **counts}


_MEANS = ("first_s", "wall_s", "cpu_s", "rss_gib", "steady_gib", "dev_gib", "comm_mb")


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    world = 2 if args.device == "cpu" else min(2, torch.cuda.device_count())
    for _ in range(args.repeat):
        for stage in args.stages:
            modes = [(None, False, False)] + ([] if args.no_plain else [(args.backend, False, False)]) + \
                ([(args.backend, True, False)] if args.deepcompile and stage else []) + \
                ([(args.backend, False, True)] if args.fsdp2 and stage == 3 else [])
            for backend, deep, fsdp2 in modes:
                with tempfile.TemporaryDirectory(prefix="bench_compile_inductor_") as cache:
                    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # cold compile, as on a fresh machine
                    ranks = run_distributed(_rank, world, args.preset, args.micro_batch, args.steps, stage, backend,
                                            deep, args.max_reuse, fsdp2, args.free_activation, timeout=3600,
                                            backend="nccl" if args.device == "cuda" else "gloo")
                mean = {k: sum(r[k] for r in ranks) / len(ranks) for k in _MEANS}
                mode = ("eager" if backend is None else f"fsdp2 + torch.compile {backend}" if fsdp2
                        else f"deepcompile {backend}" if deep else backend)
                rows.append({"stage": stage, "mode": mode, **mean, "colls": ranks[0]["colls"], "graphs": ranks[0]["graphs"],
                             "graph_breaks": ranks[0]["graph_breaks"], "losses": ranks[0]["losses"]})
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean over repeats per (stage, mode), with the compiled/eager ratios and the compile time."""
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["stage"], r["mode"])
        acc = out.setdefault(key, {"stage": r["stage"], "mode": r["mode"], "n": 0, **{k: 0.0 for k in _MEANS},
                                   "colls": r["colls"], "graphs": r["graphs"], "graph_breaks": r["graph_breaks"],
                                   "losses": r["losses"]})
        acc["n"] += 1
        for k in _MEANS:
            acc[k] += r[k]
    for acc in out.values():
        for k in _MEANS:
            acc[k] /= acc["n"]
    for (stage, mode), acc in out.items():
        eager = out[(stage, "eager")]
        acc["compile_s"] = acc["first_s"] - eager["wall_s"] if mode != "eager" else 0.0
        acc["wall_ratio"] = acc["wall_s"] / eager["wall_s"]
        acc["cpu_ratio"] = acc["cpu_s"] / eager["cpu_s"]
        acc["max_loss_diff"] = max(abs(a - b) for a, b in zip(acc["losses"], eager["losses"]))
    return list(out.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 3])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--deepcompile", action="store_true", help="also compile.deepcompile: true (stages 1-3)")
    parser.add_argument("--fsdp2", action="store_true", help="also FSDP2 + torch.compile (stage 3)")
    parser.add_argument("--free-activation", action="store_true", help="DeepCompile with compile.free_activation")
    parser.add_argument("--no-plain", action="store_true", help="skip plain engine.compile()")
    parser.add_argument("--max-reuse", type=int, default=None, help="zero_optimization.stage3_max_reuse_distance")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_compile: --device cuda, but no CUDA device here; nothing to measure")
        return
    summary = summarize(measure(args))
    if args.json:
        for row in summary:
            print(json.dumps(row))
        return
    where = "world 2 (Gloo, CPU)" if args.device == "cpu" else f"{torch.cuda.get_device_name(0)}, NCCL"
    print(f"GPT {args.preset}, {where}, micro-batch {args.micro_batch}, {args.steps} steps, "
          f"repeat {args.repeat}, torch {torch.__version__}, {os.cpu_count()} cores")
    print("| stage | mode | first step s | compile s | wall s/step | CPU s/step | wall vs eager | CPU vs eager "
          "| peak RSS GiB | steady RSS GiB | peak dev GiB | comm MB/step | colls/step | graphs | breaks | max loss diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in summary:
        print(f"| {r['stage']} | {r['mode']} | {r['first_s']:.2f} | {r['compile_s']:.1f} | {r['wall_s']:.3f} | "
              f"{r['cpu_s']:.3f} | {r['wall_ratio']:.2f}x | {r['cpu_ratio']:.2f}x | {r['rss_gib']:.2f} | "
              f"{r['steady_gib']:.2f} | {r['dev_gib']:.2f} | {r['comm_mb']:.1f} | {r['colls']} | {r['graphs']} | "
              f"{r['graph_breaks']} | {r['max_loss_diff']:.1e} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
