"""The reducer's phase events, for observers (``profiling/memory_timeline.py``) instead of method patching.

A subscriber has ``enter(phase, owner)`` and ``leave(phase, owner)``: ``phase`` is ``"reduce"`` around the
reducer's collectives (launch, completion, the end of backward, the late settle) or None around work that
only makes or fills buffers; ``owner`` names the memory made inside (``"grad_buckets"``,
``"grad_partitions"``). Without subscribers a span costs one check.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol


class Subscriber(Protocol):
    def enter(self, phase: str | None, owner: str) -> None: ...

    def leave(self, phase: str | None, owner: str) -> None: ...


class _Span:
    def __init__(self, subscribers: list[Subscriber], phase: str | None, owner: str) -> None:
        self.subscribers, self.phase, self.owner = subscribers, phase, owner

    def __enter__(self) -> None:
        for s in self.subscribers:
            s.enter(self.phase, self.owner)

    def __exit__(self, *exc: Any) -> None:
        for s in reversed(self.subscribers):
            s.leave(self.phase, self.owner)


class ReducerEvents:
    def __init__(self) -> None:
        self.subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Add ``subscriber``; returns the call that removes it."""
        self.subscribers.append(subscriber)
        return lambda: self.subscribers.remove(subscriber)

    def span(self, phase: str | None, owner: str) -> AbstractContextManager[Any]:
        return _Span(list(self.subscribers), phase, owner) if self.subscribers else nullcontext()
