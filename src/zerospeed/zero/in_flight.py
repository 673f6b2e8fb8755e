"""A bucket's gradient collective in flight, and how many may be (the reducer's double buffering)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import comm

MAX_IN_FLIGHT = 2  # bucket collectives launched and not yet completed (double buffering)


@dataclass
class InFlight:
    """A bucket's collective in flight; ``direct``: its reduce-scatter writes straight into the destination;
    ``local``: not reduced (one rank, or each rank keeps its local gradient)."""

    g: int
    b: int
    handle: comm.Handle | None
    send: torch.Tensor
    out: torch.Tensor | None
    local: bool = False
    direct: bool = False
