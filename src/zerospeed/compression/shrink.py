"""Make pruning permanent (``redundancy_clean``): multiply the masks in, or cut the pruned units out.

Without related modules a pruned row, head or channel is only zeroed. With them (``dim_reduction``) the layer
loses its pruned output rows (row), output channels (channel) or the input columns of its pruned heads (head,
on the attention output projection), and each related layer loses what fed or read them: the input columns
that read the pruned rows (row), the input channels (channel; a BatchNorm its features), the output rows of the
pruned heads (head; a fused QKV layer of ``m * heads * head_dim`` rows loses them in each of its ``m``
blocks). The mask is returned so the caller can hand it to the related layers.
"""

from __future__ import annotations

import torch
from torch import nn


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone().contiguous())


def _set_linear(layer: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    layer.weight = _param(weight)
    if bias is not None:
        layer.bias = _param(bias)
    if isinstance(layer, nn.Linear):
        layer.out_features, layer.in_features = layer.weight.shape
    elif isinstance(layer, nn.Conv2d):
        layer.out_channels, layer.in_channels = layer.weight.shape[0], layer.weight.shape[1] * layer.groups


def fix_outputs(layer: nn.Module, unit: str, dim_reduction: bool) -> torch.Tensor:
    """Row pruning (linear) or channel pruning (convolution): the kept output mask ``[out]`` (bool); the pruned
    outputs (weight rows or filters, and their bias) cut out or zeroed."""
    keep = layer.get_mask(unit).detach().reshape(-1).bool()  # type: ignore[operator]
    bias = layer.bias
    if dim_reduction:
        _set_linear(layer, layer.weight[keep], None if bias is None else bias[keep])
    else:
        layer.weight.data = layer.weight.data * keep.reshape(-1, *[1] * (layer.weight.dim() - 1))
        if bias is not None:
            bias.data = bias.data * keep
    layer._drop_mask(unit)  # type: ignore[operator]
    return keep


def fix_columns(layer: nn.Module, keep: torch.Tensor) -> None:
    """A related layer of row pruning: only the input columns that read kept rows stay."""
    _set_linear(layer, layer.weight[:, keep], None)


def fix_heads(layer: nn.Module, dim_reduction: bool) -> torch.Tensor:
    """Head pruning on the output projection: the kept-head mask ``[heads]``; input columns cut or zeroed."""
    keep = layer.get_mask("head").detach().reshape(-1).bool()  # type: ignore[operator]
    heads = layer.num_heads
    out, inp = layer.weight.shape
    by_head = layer.weight.detach().t().reshape(heads, -1)
    if dim_reduction:
        _set_linear(layer, by_head[keep].reshape(-1, out).t(), None)
    else:
        layer.weight.data = (by_head * keep.reshape(-1, 1).to(by_head.dtype)).reshape(inp, out).t()
    layer._drop_mask("head")  # type: ignore[operator]
    return keep


def fix_head_rows(layer: nn.Module, keep: torch.Tensor, head_dim: int) -> None:
    """A related layer of head pruning (Q, K, V or a fused QKV): the pruned heads' output rows are cut.

    Its rows are ``m`` blocks of ``heads * head_dim`` (``m`` = 1 for Q, K or V, 3 for a fused QKV)."""
    heads, (out, inp) = keep.numel(), layer.weight.shape
    if out % (heads * head_dim):
        raise ValueError(f"a related layer of {out} rows does not hold {heads} heads of {head_dim}")
    blocks = out // (heads * head_dim)
    w = layer.weight.detach().reshape(blocks, heads, -1)[:, keep].reshape(-1, inp)
    bias = layer.bias
    b = None if bias is None else bias.detach().reshape(blocks, heads, -1)[:, keep].reshape(-1)
    _set_linear(layer, w, b)


def fix_in_channels(layer: nn.Module, keep: torch.Tensor) -> None:
    """A related layer of channel pruning: a convolution keeps the kept input channels, a BatchNorm its features."""
    if isinstance(layer, nn.BatchNorm2d):
        layer.weight, layer.bias = _param(layer.weight[keep]), _param(layer.bias[keep])
        layer.running_mean = layer.running_mean[keep].clone()
        layer.running_var = layer.running_var[keep].clone()
        layer.num_features = int(keep.sum())
        return
    _set_linear(layer, layer.weight[:, keep], None)
