"""Which experiments may run: per-rank model-state bytes of a ZeRO stage (DeepSpeed's estimator formulas for
mixed precision, fp32 here: 16 bytes of Adam state + master per parameter, sharded by stage) against the
memory the machine has, so a configuration that cannot fit is never launched."""

from __future__ import annotations

from typing import Any


def model_state_bytes(num_params: int, stage: int, world: int, offload_optimizer: bool = False,
                      bytes_per_param: int = 4) -> int:
    """Parameters + gradients + fp32 master + Adam moments per rank (accounted, before activations)."""
    p = g = bytes_per_param * num_params
    opt = 8 * num_params + (0 if bytes_per_param == 4 else 4 * num_params)  # moments (+ master when not fp32)
    if stage >= 1:
        opt //= world
    if stage >= 2:
        g //= world
    if stage >= 3:
        p //= world
    if offload_optimizer:
        opt = 0
    return p + g + opt


def fits(exp: dict[str, Any], num_params: int, world: int, available: int, headroom: float = 0.5) -> bool:
    """``exp``'s model states take at most ``headroom`` of ``available`` bytes (the rest: activations, buffers)."""
    zero = exp.get("zero_optimization", {})
    offload = (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    need = model_state_bytes(num_params, int(zero.get("stage", 0)), world, offload)
    return need <= headroom * available / max(world, 1)
