"""``zerospeed plan CONFIG --model ...``: per-rank peak memory predicted before any rank starts.

Nothing is allocated: the model is built on the meta device and the prediction is arithmetic
(``profiling/plan.py``). Imports torch only when run.
"""

from __future__ import annotations

import argparse

from zerospeed.launcher.command import Command, UsageError

_HELP = """Predict the per-rank peak memory of training MODEL with the DeepSpeed config CONFIG, by owner: parameters,
gradients (buffers and partitions), fp32 master, optimizer state, gradient buckets / step buffers, gathered
ZeRO-3 parameters, activations for the micro-batch and sequence length, and the framework's own cost.

What is predicted: the peak resident memory of one rank *over its RSS at the start of the training script*
(after `import torch` and joining the process group), through model build, initialize() and the first steps;
"total (absolute RSS)" adds a baseline, the RSS of a bare `import torch, zerospeed` process (measured here:
about 220 MiB; --measure-baseline measures it on this machine, --baseline-mib sets it). Parts are formulas
from zerospeed's own buffer rules and per-architecture activation formulas; two are measured constants
(framework cost, backward working-set factor): see docs/migration.md "Memory plan". On CPU the figure is
host RSS; with CUDA the same model-state and activation rows are device bytes."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="DeepSpeed/zerospeed JSON config")
    parser.add_argument("--model", required=True, help="gpt:<tiny|demo|bench> (zerospeed GPT presets), or "
                        "hf:<gpt2-tiny|gpt2-test|gpt2|gpt2-medium|path/to/config.json|dir> (a GPT-2 built from a "
                        "transformers config; nothing is downloaded)")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences per rank per micro-step (default: the config's micro-batch)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--stage", type=int, default=None, choices=[0, 1, 2, 3], help="override the ZeRO stage")
    parser.add_argument("--baseline-mib", type=float, default=None, help="RSS of a bare torch process in MiB")
    parser.add_argument("--measure-baseline", action="store_true",
                        help="measure the baseline by starting `python -c 'import torch, zerospeed'`")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def _measure_baseline() -> int:
    import subprocess
    import sys

    code = "import torch, zerospeed, psutil; print(psutil.Process().memory_info().rss)"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def run(args: argparse.Namespace) -> int:
    from zerospeed.config import ConfigError, load_config
    from zerospeed.profiling.plan import MIB, inputs_from_config, predict
    from zerospeed.profiling.plan_models import model_spec

    if args.world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {args.world_size}")
    try:
        cfg = load_config(args.config)
        inputs = inputs_from_config(cfg, args.world_size, args.micro_batch, args.seq, args.stage)
        plan = predict(model_spec(args.model), inputs)
    except (ConfigError, ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    if args.measure_baseline:
        plan.baseline_bytes = _measure_baseline()
    elif args.baseline_mib is not None:
        plan.baseline_bytes = int(args.baseline_mib * MIB)
    if not args.json:
        print(plan.table())
    print(plan.json_line())
    return 0


COMMAND = Command(
    name="plan",
    help="predict per-rank peak memory for a model and config before launching",
    description=_HELP,
    add_arguments=add_arguments,
    run=run,
)
