"""``zerospeed alias install|uninstall [--target DIR]``: make ``import deepspeed`` resolve to zerospeed."""

from __future__ import annotations

import argparse
from pathlib import Path

from zerospeed.launcher.command import Command, UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["install", "uninstall"])
    parser.add_argument("--target", default=None, metavar="DIR",
                        help="the site directory to write into (default: this environment's site-packages)")


def run(args: argparse.Namespace) -> int:
    from zerospeed import deepspeed_alias

    site = None if args.target is None else Path(args.target)
    try:
        if args.action == "install":
            paths = deepspeed_alias.install(site)
            print(f"zerospeed alias: `import deepspeed` now resolves to zerospeed (deepspeed "
                  f"{deepspeed_alias.alias_version()}); wrote {', '.join(str(p) for p in paths)}")
        else:
            paths = deepspeed_alias.uninstall(site)
            print("zerospeed alias: removed " + (", ".join(str(p) for p in paths) if paths else "nothing (no alias)"))
    except deepspeed_alias.AliasError as exc:
        raise UsageError(str(exc)) from None
    return 0


COMMAND = Command(
    name="alias",
    help="make `import deepspeed` resolve to zerospeed here (install), or undo it (uninstall)",
    description=("Writes a tiny `deepspeed` package and a deepspeed dist-info into the site directory, so that "
                 "scripts and frameworks (transformers, Accelerate, Lightning) that import deepspeed run on "
                 "zerospeed unchanged. Refuses when the real DeepSpeed is installed."),
    add_arguments=add_arguments,
    run=run,
)
