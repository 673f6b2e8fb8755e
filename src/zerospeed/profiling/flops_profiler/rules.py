"""Counting rules: how many MACs and FLOPs one operator performs, from its tensor shapes.

Conventions (the same as DeepSpeed's flops profiler, so numbers compare):

* matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``, ``dot``; so ``nn.Linear`` and ``matmul``):
  MACs = product of the output elements and the contracted size; FLOPs = 2 * MACs. A bias fused into
  ``addmm``/``baddbmm`` is *not* counted (DeepSpeed: linear FLOPs = 2 * MACs).
* convolution (and transposed): MACs = output (input, when transposed) elements * (in/groups channels) *
  kernel size; FLOPs = 2 * MACs + one add per output element when there is a bias (as DeepSpeed).
* attention (``F.scaled_dot_product_attention`` and its fused kernels): the two products
  ``Q @ K^T`` and ``P @ V``: MACs = B * H * L * S * (E + Ev), FLOPs = 2 * MACs; softmax, scaling and
  masking inside the kernel are not counted, and a causal mask does not halve the count.
* embedding lookups and dropout: 0.
* activations and softmax: 1 FLOP per output element; layer/group norm: 5 per element with an affine weight
  (4 without); batch norm: 5/4 when training, 2/1 in eval; elementwise arithmetic (add, sub, mul, div, pow,
  sqrt, rsqrt, exp): 1 per output element; reductions (sum, mean): 1 per input element. None have MACs.

Operators with no rule here fall back to ``torch.utils.flop_counter``'s registry (MACs = FLOPs / 2), and
are otherwise counted as 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import flop_counter

aten = torch.ops.aten

Counts = tuple[int, int]  # (flops, macs)
Rule = Callable[[Sequence[Any], dict[str, Any], Any], Counts]


def _numel(x: Any) -> int:
    return x.numel() if isinstance(x, torch.Tensor) else 0


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, tuple | list):
        for item in x:
            if isinstance(item, torch.Tensor):
                return item
    return None


def _product(m: int, k: int, n: int, batch: int = 1) -> Counts:
    macs = batch * m * k * n
    return 2 * macs, macs


def _mm(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    a, b = args[0], args[1]
    return _product(a.shape[0], a.shape[1], b.shape[1])


def _addmm(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    return _mm(args[1:], kwargs, out)


def _bmm(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    a, b = args[0], args[1]
    return _product(a.shape[1], a.shape[2], b.shape[2], batch=a.shape[0])


def _baddbmm(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    return _bmm(args[1:], kwargs, out)


def _mv(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    return _product(args[0].shape[0], args[0].shape[1], 1)


def _dot(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    return _product(1, args[0].shape[0], 1)


def _convolution(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    x, weight, bias = args[0], args[1], args[2]
    transposed = bool(args[6]) if len(args) > 6 else False
    # Every weight element meets every spatial position once: of the output normally, of the input when
    # transposed (weight is (out, in/groups, *k), resp. (in, out/groups, *k), so groups are already folded in).
    source = x if transposed else out
    macs = source.shape[0] * math.prod(source.shape[2:]) * weight.numel()
    flops = 2 * macs + (_numel(out) if bias is not None else 0)
    return flops, macs


def attention_counts(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Counts:
    """Q @ K^T then P @ V: MACs = (batch * heads * L) * S * (E + Ev)."""
    rows = math.prod(query.shape[:-1])
    macs = rows * key.shape[-2] * (query.shape[-1] + value.shape[-1])
    return 2 * macs, macs


def _attention(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    return attention_counts(args[0], args[1], args[2])


def _zero(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    return 0, 0


def _per_output(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    tensor = _first_tensor(out)
    return (_numel(tensor), 0)


def _per_input(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    return _numel(args[0]), 0


def _norm(affine_index: int) -> Rule:
    def rule(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
        affine = len(args) > affine_index and args[affine_index] is not None
        return _numel(args[0]) * (5 if affine else 4), 0

    return rule


def _batch_norm(training_index: int | None) -> Rule:
    def rule(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
        affine = args[1] is not None
        training = bool(args[training_index]) if training_index is not None else False
        per_element = (5 if affine else 4) if training else (2 if affine else 1)
        return _numel(args[0]) * per_element, 0

    return rule


def _packets(*names: str) -> list[Any]:
    return [getattr(aten, n) for n in names if hasattr(aten, n)]


RULES: dict[Any, Rule] = {}
for _packet, _rule in [
    (_packets("mm"), _mm),
    (_packets("addmm"), _addmm),
    (_packets("bmm"), _bmm),
    (_packets("baddbmm"), _baddbmm),
    (_packets("mv", "addmv"), _mv),
    (_packets("dot", "vdot"), _dot),
    (_packets("convolution", "_convolution", "cudnn_convolution", "convolution_overrideable"), _convolution),
    (
        _packets(
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_fused_attention_overrideable",
            "_scaled_dot_product_attention_math",
        ),
        _attention,
    ),
    (_packets("embedding", "_embedding_bag", "embedding_bag", "native_dropout", "bernoulli", "bernoulli_"), _zero),
    (
        _packets(
            "relu", "relu_", "gelu", "gelu_", "silu", "silu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "elu",
            "elu_", "leaky_relu", "leaky_relu_", "hardtanh", "hardtanh_", "hardswish", "hardsigmoid", "mish",
            "softplus", "_prelu_kernel", "_softmax", "_log_softmax", "_safe_softmax",
            "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "pow", "sqrt", "rsqrt", "exp",
        ),
        _per_output,
    ),
    (_packets("sum", "mean"), _per_input),
    (_packets("native_layer_norm"), _norm(2)),
    (_packets("native_group_norm"), _norm(1)),
    (_packets("native_batch_norm", "_native_batch_norm_legit"), _batch_norm(5)),
    (_packets("_native_batch_norm_legit_no_training"), _batch_norm(None)),
]:
    for _p in _packet:
        RULES[_p] = _rule


def count_op(func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    """(FLOPs, MACs) of one aten operator call; (0, 0) for operators that do no arithmetic we count."""
    packet = getattr(func, "overloadpacket", func)
    rule = RULES.get(packet)
    if rule is not None:
        return rule(args, kwargs, out)
    fallback = flop_counter.flop_registry.get(packet)
    if fallback is not None:
        flops = int(fallback(*args, **kwargs, out_val=out))
        return flops, flops // 2
    return 0, 0
