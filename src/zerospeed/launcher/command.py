"""One subcommand of the ``zerospeed`` command line: a name, its arguments and the function that runs it.

A new subcommand is a small module that defines ``COMMAND = Command(...)``, listed once in ``cli.COMMANDS``.
Modules must stay cheap to import (no ``torch`` at import time): ``zerospeed --help`` imports them all.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


class UsageError(ValueError):
    """The user called a command wrongly; ``cli.main`` prints the message and exits with code 2."""


@dataclass(frozen=True)
class Command:
    """A subcommand: ``add_arguments`` fills its parser; ``run`` takes the parsed args, returns the exit code."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str = ""
