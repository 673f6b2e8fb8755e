"""Counting rules: DeepSpeed's flops-profiler conventions, one rule per torch function it counts.

DeepSpeed counts the calls of a fixed set of functions (it monkey-patches them); everything else is 0.
We count the same calls through a ``TorchFunctionMode`` (see :mod:`.counter`), with the same formulas, so
the numbers equal DeepSpeed's (checked against DeepSpeed 0.19.8 in ``tests/unit/test_flops_deepspeed_parity.py``):

* ``F.linear``: MACs = input elements * out features, FLOPs = 2 * MACs (the bias is *not* counted);
  ``torch.addmm`` / ``Tensor.addmm`` / ``torch.baddbmm``: 2 * MACs + the elements of the added tensor;
  ``torch.matmul`` / ``Tensor.matmul`` / ``@`` / ``mm`` / ``bmm``: MACs = input elements * other's last dim;
* convolutions: MACs = output positions * kernel size * in channels * filters per group; FLOPs = 2 * MACs
  plus one add per output element with a bias (transposed: MACs over the positions of the *input*);
* ``F.scaled_dot_product_attention``: ``Q @ K^T`` and ``P @ V`` (softmax, scale, mask not counted);
* ``F.relu``, ``F.prelu``, ``F.elu``, ``F.leaky_relu``, ``F.relu6``, ``F.silu``, ``F.gelu``, ``F.softmax``
  and every pooling: 1 FLOP per *input* element. Not counted (0): ``torch.tanh``/``nn.Tanh``, sigmoid,
  hardswish, ``nn.ReLU6`` (it runs ``F.hardtanh``), ``Tensor.softmax``, dropout, embeddings;
* norms: layer/group/instance norm 5 FLOPs per element with an affine weight, 4 without; batch norm the
  same in training, 2 (affine) or 1 in eval;
* ``F.interpolate``: the output size's elements when ``size`` is given (no batch or channels), else
  input elements * scale_factor ** spatial dims;
* ``torch.mul``/``Tensor.mul``/``torch.add``/``Tensor.add``: elements of the broadcast result. Operator
  syntax (``a * b``, ``a + b``) is not counted: DeepSpeed never sees it;
* ``torch.einsum``: numpy's optimal contraction cost (``np.einsum_path``), no MACs;
* RNN modules (``nn.RNN/GRU/LSTM`` and their cells) are priced per module by :func:`rnn_module_flops`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

Counts = tuple[int, int]  # (flops, macs)
Rule = Callable[..., Counts]


def _numel(shape: Any) -> int:
    return math.prod(shape)


def _per_input(input: torch.Tensor, *args: Any, **kwargs: Any) -> Counts:
    return input.numel(), 0


def _zero(*args: Any, **kwargs: Any) -> Counts:
    return 0, 0


def _linear(input: torch.Tensor, weight: torch.Tensor, bias: Any = None) -> Counts:
    macs = input.numel() * weight.shape[0]
    return 2 * macs, macs


def _spatial(value: Any, length: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, tuple | list) else (value,) * length


def _conv(input: torch.Tensor, weight: torch.Tensor, bias: Any = None, stride: Any = 1, padding: Any = 0,
          dilation: Any = 1, groups: int = 1) -> Counts:
    kernel, dims = list(weight.shape[2:]), list(input.shape[2:])
    strides, dilations = _spatial(stride, len(dims)), _spatial(dilation, len(dims))
    if padding == "valid":
        paddings: tuple[int, ...] = (0,) * len(dims)
    elif padding == "same":
        paddings = tuple(d * (k - 1) // 2 for d, k in zip(dilations, kernel))
    else:
        paddings = _spatial(padding, len(dims))
    out = [(n + 2 * p - (d * (k - 1) + 1)) // s + 1 for n, p, d, k, s in zip(dims, paddings, dilations, kernel, strides)]
    positions = input.shape[0] * _numel(out)
    macs = _numel(kernel) * input.shape[1] * (weight.shape[0] // groups) * positions
    bias_flops = weight.shape[0] * positions if bias is not None else 0
    return 2 * macs + bias_flops, macs


def _conv_transpose(input: torch.Tensor, weight: torch.Tensor, bias: Any = None, stride: Any = 1,
                    padding: Any = 0, output_padding: Any = 0, groups: int = 1, dilation: Any = 1) -> Counts:
    kernel, dims = list(weight.shape[2:]), list(input.shape[2:])
    paddings, strides = _spatial(padding, len(dims)), _spatial(stride, len(dims))
    dilations, extra = _spatial(dilation, len(dims)), _spatial(output_padding, len(dims))
    out = [(n - 1) * s - 2 * p + d * (k - 1) + e + 1
           for n, s, p, d, k, e in zip(dims, strides, paddings, dilations, kernel, extra)]
    macs = _numel(kernel) * input.shape[1] * weight.shape[1] * input.shape[0] * _numel(dims)
    bias_flops = weight.shape[1] * groups * input.shape[0] * _numel(out) if bias is not None else 0
    return 2 * macs + bias_flops, macs


def _affine_norm(input: torch.Tensor, weight: Any) -> Counts:
    return input.numel() * (5 if weight is not None else 4), 0


def _layer_norm(input: torch.Tensor, normalized_shape: Any, weight: Any = None, *args: Any, **kw: Any) -> Counts:
    return _affine_norm(input, weight)


def _group_norm(input: torch.Tensor, num_groups: int, weight: Any = None, *args: Any, **kw: Any) -> Counts:
    return _affine_norm(input, weight)


def _instance_norm(input: torch.Tensor, running_mean: Any = None, running_var: Any = None, weight: Any = None,
                   *args: Any, **kw: Any) -> Counts:
    return _affine_norm(input, weight)


def _batch_norm(input: torch.Tensor, running_mean: Any, running_var: Any, weight: Any = None, bias: Any = None,
                training: bool = False, *args: Any, **kw: Any) -> Counts:
    if training:
        return _affine_norm(input, weight)
    return input.numel() * (2 if weight is not None else 1), 0


def _interpolate(input: torch.Tensor, size: Any = None, scale_factor: Any = None, *args: Any, **kw: Any) -> Counts:
    if size is not None:
        return (_numel(size) if isinstance(size, tuple | list) else int(size)), 0
    if scale_factor is None:
        raise ValueError("flops profiler: interpolate needs size or scale_factor")
    if isinstance(scale_factor, tuple | list):
        return int(input.numel() * _numel(scale_factor)), 0
    return int(input.numel() * scale_factor ** (input.ndim - 2)), 0


def _matmul(input: torch.Tensor, other: torch.Tensor, *args: Any, **kwargs: Any) -> Counts:
    macs = input.numel() * other.shape[-1]
    return 2 * macs, macs


def _addmm(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *args: Any, **kwargs: Any) -> Counts:
    macs = mat1.numel() * mat2.shape[-1]
    return 2 * macs + input.numel(), macs


def _elementwise(input: Any, other: Any, *args: Any, **kwargs: Any) -> Counts:
    if not isinstance(input, torch.Tensor):
        return (other.numel() if isinstance(other, torch.Tensor) else 1), 0
    if not isinstance(other, torch.Tensor):
        return input.numel(), 0
    return _numel(torch.broadcast_shapes(input.shape, other.shape)), 0


def _einsum(equation: str, *operands: Any) -> Counts:
    if len(operands) == 1 and isinstance(operands[0], tuple | list):
        operands = tuple(operands[0])
    equation = equation.replace(" ", "")
    letters = OrderedDict((c, 0) for c in equation if c.isalpha()).keys()
    equation = equation.translate({ord(c): 97 + i for i, c in enumerate(letters)})
    views = [np.broadcast_to(np.zeros(1), tuple(o.shape)) for o in operands]  # shapes only, no memory
    report = np.einsum_path(equation, *views, optimize="optimal")[1]
    for line in report.split("\n"):
        if "optimized flop" in line.lower():
            return int(float(line.split(":")[-1])), 0
    raise ValueError(f"flops profiler: cannot count einsum {equation!r}")


def attention_counts(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Counts:
    """Q @ K^T then P @ V: MACs = (batch * heads * L) * S * (E + Ev)."""
    macs = query.numel() * key.shape[-2] + _numel(query.shape[:-1]) * key.shape[-2] * value.shape[-1]
    return 2 * macs, macs


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Counts:
    return attention_counts(query, key, value)


def _functions(*names: str, owner: Any = F) -> list[Any]:
    return [getattr(owner, n) for n in names if hasattr(owner, n)]


# ``F.max_pool2d(..., return_indices=True)`` reaches the mode as ``F.max_pool2d_with_indices``: DeepSpeed
# counts it (as the ``F.max_pool2d`` call it is). ``F.adaptive_max_pool2d`` calls it inside: not again.
POOL_ALIASES = frozenset(
    _functions(*(f"{kind}_pool{n}d_with_indices" for kind in ("max", "adaptive_max") for n in (1, 2, 3)))
)


def _build_rules() -> dict[Any, Rule]:
    table: list[tuple[list[Any], Rule]] = [
        (_functions("linear"), _linear),
        (_functions("conv1d", "conv2d", "conv3d"), _conv),
        (_functions("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"), _conv_transpose),
        (_functions("relu", "prelu", "elu", "leaky_relu", "relu6", "silu", "gelu", "softmax"), _per_input),
        (_functions(*(f"{kind}_pool{n}d" for kind in ("avg", "max", "adaptive_avg", "adaptive_max")
                      for n in (1, 2, 3))), _per_input),
        (sorted(POOL_ALIASES, key=str), _per_input),
        (_functions("batch_norm"), _batch_norm),
        (_functions("layer_norm"), _layer_norm),
        (_functions("group_norm"), _group_norm),
        (_functions("instance_norm"), _instance_norm),
        (_functions("upsample", "interpolate"), _interpolate),
        (_functions("embedding"), _zero),
        (_functions("scaled_dot_product_attention"), _attention),
        (_functions("matmul", "mm", "bmm", owner=torch), _matmul),
        (_functions("matmul", "mm", "bmm", owner=torch.Tensor), _matmul),
        (_functions("addmm", "baddbmm", owner=torch) + _functions("addmm", owner=torch.Tensor), _addmm),
        (_functions("mul", "add", owner=torch), _elementwise),
        (_functions("mul", "add", owner=torch.Tensor), _elementwise),
        (_functions("einsum", owner=torch), _einsum),
    ]
    return {fn: rule for fns, rule in table for fn in fns}


RULES: dict[Any, Rule] = _build_rules()
# Tensor methods that Python's operators share: ``a * b`` reaches us as ``Tensor.mul`` too (see counter).
OPERATOR_METHODS = frozenset(_functions("mul", "add", owner=torch.Tensor))


def count_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Counts | None:
    """(FLOPs, MACs) of one call of ``func`` by DeepSpeed's rules; None when DeepSpeed does not count it."""
    rule = RULES.get(func)
    return None if rule is None else rule(*args, **kwargs)


# --- RNN modules: DeepSpeed prices them per module (their kernels are not functions it counts) ----------
RNN_MODULES = (nn.RNN, nn.GRU, nn.LSTM, nn.RNNCell, nn.GRUCell, nn.LSTMCell)


def _rnn_step_flops(module: nn.Module, w_ih: torch.Tensor, w_hh: torch.Tensor) -> int:
    gates, h = w_ih.shape[0], module.hidden_size
    flops = 2 * w_ih.shape[0] * w_ih.shape[1] - gates + 2 * w_hh.shape[0] * w_hh.shape[1] - gates
    if isinstance(module, nn.RNN | nn.RNNCell):
        flops += h
    elif isinstance(module, nn.GRU | nn.GRUCell):
        flops += h + 3 * h + 3 * h
    elif isinstance(module, nn.LSTM | nn.LSTMCell):
        flops += 4 * h + 3 * h + 3 * h
    return flops


def rnn_module_flops(module: nn.Module, inputs: tuple[Any, ...]) -> int:
    """DeepSpeed's estimate for one forward of an RNN module (or cell), from its weights and input shape."""
    x = inputs[0]
    if isinstance(module, nn.RNNCell | nn.GRUCell | nn.LSTMCell):
        flops = _rnn_step_flops(module, module.weight_ih, module.weight_hh)
        if module.bias:
            flops += module.bias_ih.shape[0] + module.bias_hh.shape[0]
        return flops * x.shape[0]
    flops = 0
    for i in range(module.num_layers):
        flops += _rnn_step_flops(module, getattr(module, f"weight_ih_l{i}"), getattr(module, f"weight_hh_l{i}"))
        if module.bias:
            flops += getattr(module, f"bias_ih_l{i}").shape[0] + getattr(module, f"bias_hh_l{i}").shape[0]
    flops *= x.shape[0] * x.shape[1]  # DeepSpeed reads (batch, seq) from the first two dims, as given
    return flops * (2 if module.bidirectional else 1)
