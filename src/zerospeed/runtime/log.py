"""DeepSpeed's ``deepspeed.utils.logger`` and ``log_dist``: the ``zerospeed`` logger, and a log call that
only the listed ranks make.

The logger gets no handler of its own: configure it like any library logger (``logging.basicConfig``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from .. import comm

logger = logging.getLogger("zerospeed")
_seen: set[str] = set()  # messages log_dist_once has logged (per process, as in DeepSpeed)


def _mine(ranks: Iterable[int] | None) -> bool:
    rank = comm.get_rank() if comm.is_initialized() else 0
    wanted = [0] if ranks is None else list(ranks)
    return -1 in wanted or rank in wanted


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ranks in ``ranks`` (``None``: rank 0; ``[-1]``: every rank), prefixed with the rank."""
    if _mine(ranks):
        rank = comm.get_rank() if comm.is_initialized() else 0
        logger.log(level, f"[Rank {rank}] {message}")


def log_dist_once(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """``log_dist``, at most once per process for the same message."""
    if message not in _seen:
        _seen.add(message)
        log_dist(message, ranks, level)


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """DeepSpeed's helper: ``"info"``, ``"debug"``, ... (case-insensitive), set on the logger and on each of
    its handlers."""
    level = logging.getLevelName(log_level_str.upper())
    if not isinstance(level, int):
        raise ValueError(f"invalid log level {log_level_str!r}; one of debug, info, warning, error, critical")
    target = custom_logger or logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


__all__ = ["log_dist", "log_dist_once", "logger", "set_log_level_from_string"]
