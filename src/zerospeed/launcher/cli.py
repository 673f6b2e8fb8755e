"""``zerospeed`` command line: one argparse subparser per registered ``Command``.

To add a subcommand, write a module defining ``COMMAND = Command(...)`` (see ``command.py``) and add it
to ``COMMANDS``. DeepSpeed's form without a subcommand (``zerospeed --num_gpus 2 train.py``, like
``deepspeed train.py``) is read as ``zerospeed launch ...``.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence

import zerospeed
from zerospeed.launcher import alias, autotune, convert_accelerate, convert_deepspeed, launch, plan, report, serve, to_fp32
from zerospeed.launcher.command import Command, UsageError

COMMANDS: tuple[Command, ...] = (launch.COMMAND, to_fp32.COMMAND, convert_deepspeed.COMMAND,
                                 convert_accelerate.COMMAND, report.COMMAND, serve.COMMAND, autotune.COMMAND,
                                 plan.COMMAND, alias.COMMAND)
_TOP_LEVEL_FLAGS = ("-h", "--help", "--version")


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerospeed",
        description="zerospeed: DeepSpeed's training contract on PyTorch. "
        "Without a command, 'zerospeed [launch flags] script.py' means 'zerospeed launch ...'.",
    )
    parser.add_argument("--version", action="version", version=f"zerospeed {zerospeed.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in commands:
        child = sub.add_parser(command.name, help=command.help, description=command.description or command.help,
                               allow_abbrev=False)  # a script argument that prefixes a flag stays the script's
        command.add_arguments(child)
        child.set_defaults(_run=command.run)
    return parser


def _with_command(argv: list[str], names: Sequence[str]) -> list[str]:
    """Prefix ``launch`` when no command is named; a near-miss of a command name is an error instead."""
    if not argv or argv[0] in names or argv[0] in _TOP_LEVEL_FLAGS:
        return argv
    first = argv[0]
    if not first.startswith("-") and "." not in first and "/" not in first:
        close = difflib.get_close_matches(first, names, n=1, cutoff=0.6)
        if close:
            raise UsageError(f"unknown command '{first}'. Did you mean '{close[0]}'?")
    return ["launch", *argv]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zerospeed`` console script; returns the exit code (2 for usage errors)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    names = [command.name for command in COMMANDS]
    parser = build_parser()
    prog = "zerospeed"
    try:
        full = _with_command(args_list, names)
        prog = f"zerospeed {full[0]}" if full and full[0] in names else prog
        args = parser.parse_args(full)
        return int(args._run(args))
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse: --help, --version, bad flags
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


if __name__ == "__main__":
    sys.exit(main())
