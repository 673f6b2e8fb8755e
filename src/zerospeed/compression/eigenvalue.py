"""The largest Hessian eigenvalue of each layer block, by power iteration (DeepSpeed's ``runtime/eigenvalue.py``).

For block ``b`` with parameters ``P`` and gradients ``g = dL/dP`` (kept differentiable): start from a random
unit vector ``v`` (the global RNG's state is put back afterwards), repeat ``Hv = d(g . v)/dP``, ``e = Hv . v``,
``v = Hv / (|Hv| + stability)`` until ``|e - e_prev| / |e| < tol`` or ``max_iter``. The values are mapped to
``|e| / max |e|`` (0 becomes 1) and returned per parameter as ``{id(p): (value, block index)}``: what MoQ's
period factor reads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from ..compat.compression_helper import recursive_getattr

_log = logging.getLogger("zerospeed.compression")


class Eigenvalue:
    """DeepSpeed's constructor; ``compute_eigenvalue`` reads ``p.grad`` built with ``create_graph=True`` as
    DeepSpeed does, ``from_loss`` differentiates a loss itself (what the engine uses)."""

    def __init__(self, verbose: bool = False, max_iter: int = 100, tol: float = 1e-2, stability: float = 0,
                 gas_boundary_resolution: int = 1, layer_name: str = "", layer_num: int = 0) -> None:
        if not layer_name or layer_num < 1:
            raise ValueError("Eigenvalue needs a layer_name and layer_num >= 1")
        self.verbose, self.max_iter, self.tol, self.stability = verbose, max_iter, tol, stability
        self.gas_boundary_resolution, self.layer_name, self.layer_num = gas_boundary_resolution, layer_name, layer_num

    def blocks(self, module: nn.Module) -> list[nn.Module]:
        layers = recursive_getattr(module, self.layer_name)
        return [layers[i] for i in range(self.layer_num)]

    def _normalize(self, v: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        norm = float(_dot(v, v)) ** 0.5 + self.stability
        return [torch.nan_to_num(x / norm, nan=0.0, posinf=0.0, neginf=0.0) for x in v]

    def power_iteration(self, grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor], scale: float = 1.0) -> float:
        """The dominant eigenvalue of ``d grads / d params`` (module docstring)."""
        state = torch.random.get_rng_state()
        v = [torch.randn(p.shape, device=p.device) for p in params]
        torch.random.set_rng_state(state)
        v = self._normalize(v)
        current, previous, i = 1.0, 0.0, 0
        while i < self.max_iter and current != 0 and abs((current - previous) / current) >= self.tol:
            previous = current
            hv = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True)
            hv = [torch.nan_to_num(h, nan=0.0, posinf=0.0, neginf=0.0).float() for h in hv]
            current = float(_dot(hv, v))
            v = [x / scale for x in self._normalize(hv)]
            i += 1
        return current * scale

    def compute_eigenvalue(self, module: nn.Module, device: torch.device | None = None,
                           scale: float = 1.0) -> dict[int, tuple[float, int]]:
        """From the ``p.grad`` of a ``backward(create_graph=True)`` (DeepSpeed's contract)."""
        values, keys = [], []
        for block in self.blocks(module):
            params = [p for p in block.parameters() if p.grad is not None and p.grad.grad_fn is not None]
            if not params:
                _log.warning("The model does NOT support eigenvalue computation.")
                return {}
            values.append(self.power_iteration([p.grad for p in params], params, scale))  # type: ignore[misc]
            keys.append([id(p) for p in block.parameters()])
        return self._per_param(values, keys)

    def from_loss(self, loss: torch.Tensor, module: nn.Module) -> dict[int, tuple[float, int]]:
        """Differentiate ``loss`` (its graph is kept for the backward that follows) block by block."""
        values, keys = [], []
        for block in self.blocks(module):
            params = [p for p in block.parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
            used = [(g, p) for g, p in zip(grads, params) if g is not None and g.grad_fn is not None]
            values.append(self.power_iteration([g for g, _ in used], [p for _, p in used]) if used else 0.0)
            keys.append([id(p) for p in block.parameters()])
        return self._per_param(values, keys)

    def _per_param(self, values: list[float], keys: list[list[int]]) -> dict[int, tuple[float, int]]:
        top = max((abs(v) for v in values), default=0.0)
        mapped = [abs(v) / top if v != 0.0 and top > 0 else 1.0 for v in values]
        if self.verbose:
            _log.info("eigenvalues per block: %s", mapped)
        return {k: (value, i) for i, (ks, value) in enumerate(zip(keys, mapped)) for k in ks}


def _dot(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> torch.Tensor:
    return sum((torch.sum(x * y) for x, y in zip(xs, ys)), torch.zeros(()))


__all__ = ["Eigenvalue"]
