"""``zerospeed convert-accelerate ACCELERATE_CONFIG OUT_JSON``: an Accelerate DeepSpeed config (the YAML that
``accelerate config`` writes) as a zerospeed config file, and the ``zerospeed launch`` flags for its launcher."""

from __future__ import annotations

import argparse
import json

from zerospeed.launcher.command import Command, UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="ACCELERATE_CONFIG", help="Accelerate's config YAML (or JSON)")
    parser.add_argument("output", metavar="OUT_JSON", help="the zerospeed / DeepSpeed JSON config to write")
    parser.add_argument("--micro-batch", type=int, default=None, help="train_micro_batch_size_per_gpu to set")


def run(args: argparse.Namespace) -> int:
    from zerospeed.config import ConfigError, load_config
    from zerospeed.integrations.accelerate import from_accelerate

    try:
        cfg, flags, notes = from_accelerate(args.source, args.micro_batch)
        load_config(dict(cfg, train_micro_batch_size_per_gpu=cfg.get("train_micro_batch_size_per_gpu", 1)))
    except (ValueError, OSError, ConfigError) as exc:
        raise UsageError(str(exc)) from None
    with open(args.output, "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    print(f"zerospeed convert-accelerate: wrote {args.output}")
    print("launch with: zerospeed launch " + " ".join(flags) + f" your_script.py --deepspeed_config {args.output}")
    for note in notes:
        print(f"note: {note}")
    return 0


COMMAND = Command(
    name="convert-accelerate",
    help="convert an Accelerate DeepSpeed config into a zerospeed config",
    description=__doc__,
    add_arguments=add_arguments,
    run=run,
)
