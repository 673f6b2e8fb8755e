"""``zerospeed to-fp32 CHECKPOINT_DIR OUTPUT``: one safetensors file of the full model, no ranks started.

Streams one tensor at a time (memory: about the largest parameter, at most one model copy); verifies
every checkpoint file against its manifest first. Imports torch only when run.
"""

from __future__ import annotations

import argparse

from zerospeed.launcher.command import Command, UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="the save_dir given to save_checkpoint")
    parser.add_argument("output", metavar="OUTPUT", help="output .safetensors file, or a directory "
                        "(then OUTPUT/model.safetensors, as Hugging Face from_pretrained expects)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="dtype of floating tensors in the output (default fp32: the exact master weights)")
    parser.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the checkpoint files")


def run(args: argparse.Namespace) -> int:
    from zerospeed.runtime.checkpoint import CheckpointError, consolidate

    try:
        out = consolidate(args.checkpoint_dir, args.output, tag=args.tag, dtype=args.dtype, verify=not args.no_verify)
    except (CheckpointError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    print(f"zerospeed to-fp32: wrote {out['tensors']} tensors, {out['bytes']} bytes to {out['path']}")
    return 0


COMMAND = Command(
    name="to-fp32",
    help="consolidate a checkpoint into one safetensors file of the full model",
    description="Write the full model of a zerospeed checkpoint (any world size, any ZeRO stage) as one "
    "safetensors file, loadable with model.load_state_dict and Hugging Face from_pretrained.",
    add_arguments=add_arguments,
    run=run,
)
