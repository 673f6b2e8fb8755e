"""The sum of squares of a gradient shard, accurate to float64 at fp32's speed.

torch's CPU ``vector_norm`` of a long fp32 vector accumulates in fp32: over a 30M-element shard its square is
off by about 3e-3 relative (measured), and at ZeRO 1-3 that error reached the clip coefficient, so a clipped
run's losses left DDP's and DeepSpeed's at the fifth digit (issue 38; DeepSpeed squares each gradient in
float64). Here the shard is cut into ``CHUNK``-element pieces, each piece's norm is taken in float64 (no
temporary bigger than a piece) and the squares are summed in float64: 1.7e-14 relative error at 16 ms per 30M
elements on one CPU thread, against fp32's 10 ms.
"""

from __future__ import annotations

import torch

CHUNK = 1 << 16  # 64K elements: 512 KiB of float64 per piece; larger pieces leave the vectorised path (measured)


def sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """Σ t² as a float64 scalar on ``t``'s device."""
    flat = t.reshape(-1)
    if flat.numel() <= CHUNK:
        return torch.linalg.vector_norm(flat, dtype=torch.float64).square()
    norms = torch.stack([torch.linalg.vector_norm(x, dtype=torch.float64) for x in flat.split(CHUNK)])
    return norms.square().sum()
