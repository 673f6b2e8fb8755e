"""``zerospeed convert-deepspeed DS_CHECKPOINT_DIR OUT_DIR``: a DeepSpeed ZeRO 1-3 checkpoint becomes a
zerospeed checkpoint that resumes training (weights, optimizer state, schedule, counters). DeepSpeed's
pickles are opened weights-only: one that needs anything else is refused, never run."""

from __future__ import annotations

import argparse

from zerospeed.launcher.command import Command, UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ds_dir", metavar="DS_CHECKPOINT_DIR", help="the save_dir DeepSpeed's save_checkpoint wrote")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write the zerospeed checkpoint")
    parser.add_argument("--tag", default=None, help="DeepSpeed tag to convert (default: the one 'latest' names)")
    parser.add_argument("--out-tag", default=None, help="tag of the zerospeed checkpoint (default: global_step<N>)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace zerospeed's files in an existing OUT_DIR/<out-tag> (other files are kept)")


def run(args: argparse.Namespace) -> int:
    from zerospeed.runtime.checkpoint import CheckpointError, convert_deepspeed

    try:
        out = convert_deepspeed(args.ds_dir, args.out_dir, tag=args.tag, out_tag=args.out_tag,
                                overwrite=args.overwrite)
    except (CheckpointError, OSError, ValueError) as exc:  # bad input: one line, exit 2 (no traceback)
        raise UsageError(" ".join(str(exc).split()) or type(exc).__name__) from None
    print(f"zerospeed convert-deepspeed: DeepSpeed {out['deepspeed']} ZeRO-{out['stage']} checkpoint of "
          f"{out['world_size']} ranks -> {out['path']} ({out['tensors']} tensors). It resumes at the same world "
          "size and stage; elsewhere set \"checkpoint\": {\"load_universal\": true}.")
    return 0


COMMAND = Command(
    name="convert-deepspeed",
    help="convert a DeepSpeed ZeRO checkpoint into a zerospeed checkpoint",
    description=__doc__,
    add_arguments=add_arguments,
    run=run,
)
