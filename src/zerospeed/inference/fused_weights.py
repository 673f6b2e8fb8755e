"""One matmul for several linears that read the same input (Llama's q/k/v, gate/up), without a second copy.

``FusedLinears.build(mods)`` concatenates the weights (and biases) of plain ``nn.Linear`` layers into one
buffer and re-points each layer's parameter at its slice of that buffer (``param.data = buffer[rows]``), so
the model still holds exactly one copy of every weight, its modules and ``state_dict`` keep their names
and values, and loading new weights into a layer updates the buffer. ``__call__`` then runs one
``F.linear`` and splits the output. ``valid()`` checks, on every call, that each layer still points into
the buffer (a layer replaced by sharding or quantization, or a parameter re-assigned, makes the caller fall
back to the layers' own forwards). Layers with hooks, other types, or mixed dtype/device/bias are not fused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .gemm import linear

__all__ = ["FusedLinears"]


class FusedLinears:
    """Linears ``mods`` sharing one weight buffer; see the module docstring."""

    def __init__(self, mods: Sequence[nn.Linear], weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.mods = tuple(mods)
        self.weight, self.bias = weight, bias
        self.sizes = [m.out_features for m in mods]
        self._ptrs = [m.weight.data_ptr() for m in mods]

    @classmethod
    @torch.no_grad()
    def build(cls, mods: Sequence[nn.Module]) -> FusedLinears | None:
        """Fuse ``mods`` in place, or None when they cannot be (see module docstring)."""
        if not all(type(m) is nn.Linear for m in mods):
            return None
        if any(m._forward_hooks or m._forward_pre_hooks for m in mods):
            return None
        ws = [m.weight for m in mods]
        if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1 or len({m.bias is None for m in mods}) != 1:
            return None
        weight = torch.cat([w.detach() for w in ws])
        bias = None if mods[0].bias is None else torch.cat([m.bias.detach() for m in mods])
        at = 0
        for m in mods:
            n = m.out_features
            m.weight.data = weight[at:at + n]
            if bias is not None:
                m.bias.data = bias[at:at + n]
            at += n
        return cls(mods, weight, bias)  # type: ignore[arg-type]

    def valid(self, mods: Sequence[nn.Module]) -> bool:
        """``mods`` are still the fused layers and still read the shared buffer."""
        for a, b, p in zip(mods, self.mods, self._ptrs):  # _parameters: no Module.__getattr__ per layer
            w = a._parameters.get("weight") if a is b else None
            if w is None or w.data_ptr() != p:
                return False
        return True

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """All the layers' outputs side by side, ``[..., sum of out_features]``, in the layers' order."""
        return linear(x, self.weight, self.bias)  # through oneDNN where that pays (``gemm``)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(self.linear(x).split(self.sizes, dim=-1))
