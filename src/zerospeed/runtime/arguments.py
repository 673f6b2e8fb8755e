"""DeepSpeed's ``add_config_arguments(parser)``: the ``--deepspeed`` / ``--deepspeed_config`` options a
training script's argparse parser gains, which ``initialize(args=...)`` then reads."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's argument group (``--deepspeed``, ``--deepspeed_config``, and the deprecated
    ``--deepscale`` / ``--deepscale_config``) to ``parser``; returns the parser, as DeepSpeed does."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


__all__ = ["add_config_arguments"]


class InitializeArgumentError(ValueError, AssertionError):
    """``initialize()`` was called without what it needs (a model). DeepSpeed asserts there, so this is both a
    ``ValueError`` and an ``AssertionError``: code written for either catches it."""
