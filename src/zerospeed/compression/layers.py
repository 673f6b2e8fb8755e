"""Compression-aware layers (DeepSpeed 0.19.6's ``deepspeed.compression.basic_layer`` names).

``init_compression`` swaps every ``nn.Linear``, ``nn.Conv2d``, ``nn.Embedding`` and ``nn.BatchNorm2d`` for
these subclasses, keeping the same parameter objects (tied weights stay tied). Each technique is configured
by ``enable_*`` and acts in the forward only once the scheduler has switched its ``*_enabled`` flag on. The
linear forward, in DeepSpeed's order: quantized weight, times the sparse mask, times the row mask (weight
rows and bias), with the pruned heads' input columns zeroed; then the input is quantized if asked, and
``F.linear``. ``fix_*`` (``redundancy_clean``) make the result permanent: masks are multiplied in, or with
``dim_reduction`` the pruned rows, heads or channels are cut out (``shrink.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from . import masks
from .quantizers import QuantSpec, fake_quant
from .weight_quant import WeightQuant

TECHNIQUE_FLAGS = ("weight_quantization_enabled", "activation_quantization_enabled", "sparse_pruning_enabled",
                   "row_pruning_enabled", "head_pruning_enabled", "channel_pruning_enabled")


class QuantAct(nn.Module):
    """Static activation ranges: a running min/max (``x_min_max``, momentum 0.95) updated in training.

    Under data parallelism the engine gives it the data-parallel group (``share_ranges``): each update takes
    the min and max over every replica's micro-batch, so the replicas keep one range, the one a single process
    would see for the global batch (DeepSpeed let each rank drift to its own)."""

    def __init__(self, act_range_momentum: float = 0.95, quant_mode: str = "symmetric") -> None:
        super().__init__()
        self.act_range_momentum = act_range_momentum
        self.quant_mode = quant_mode
        self.group: Any = None
        self.register_buffer("x_min_max", torch.zeros(2))

    def share_ranges(self, group: Any) -> None:
        """Update the ranges over ``group``'s micro-batches (a collective in each training forward)."""
        self.group = group

    def _batch_range(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.stack([-x.detach().min(), x.detach().max()]).float()
        if self.group is not None and comm.get_world_size(self.group) > 1:
            comm.all_reduce(both, group=self.group, op=comm.ReduceOp.MAX)
        return -both[0], both[1]

    def forward(self, x: torch.Tensor, num_bits: int, *args: Any) -> torch.Tensor:
        if self.training:
            lo, hi = self._batch_range(x)
            if self.x_min_max[0] == self.x_min_max[1]:  # first batch: start from its own range
                self.x_min_max[0], self.x_min_max[1] = lo, hi
            m = self.act_range_momentum
            self.x_min_max[0] = self.x_min_max[0] * m + lo * (1 - m)
            self.x_min_max[1] = self.x_min_max[1] * m + hi * (1 - m)
        spec = QuantSpec(num_bits, self.quant_mode == "symmetric")
        lo, hi = self.x_min_max.to(x.dtype)  # the running range is an fp32 buffer in an fp16/bf16 model
        return fake_quant(x, spec, lo, hi)


class _Compressed:
    """What Linear and Conv2d share: flags, weight and activation quantization, sparse pruning."""

    weight: nn.Parameter
    weight_quant: WeightQuant | None
    _act_quant: tuple[int, bool, QuantAct | None] | None  # (bits, symmetric, static ranges or None: dynamic)

    def _init_compression(self) -> None:
        for flag in TECHNIQUE_FLAGS:
            setattr(self, flag, False)
        self.weight_quant = None
        self._act_quant = None
        self.sparse_pruning_method: str | None = None
        self.row_pruning_method: str | None = None
        self.head_pruning_method: str | None = None
        self.channel_pruning_method: str | None = None
        self.activation_quantization_method: str | None = None

    # --- weight quantization ---
    def enable_weight_quantization(self, start_bits: int, target_bits: int, quantization_period: int,
                                   weight_quantization_enabled_in_forward: bool, quantization_type: str,
                                   num_groups: int, rounding: str = "nearest", fp16_mixed: bool = False) -> None:
        self.weight_quant = WeightQuant(start_bits, target_bits, quantization_period,
                                        weight_quantization_enabled_in_forward, quantization_type == "symmetric",
                                        num_groups, rounding == "stochastic", fp16_mixed)

    def _weight_groups(self) -> int | None:
        return None

    def _quantized_weight(self) -> torch.Tensor:
        if self.weight_quant is not None and self.weight_quantization_enabled:  # type: ignore[attr-defined]
            return self.weight_quant.apply(self.weight, self._weight_groups())
        return self.weight

    def fix_weight_quantization(self) -> None:
        """Store the quantized weight: always in forward mode (as DeepSpeed), MoQ once it has started."""
        wq = self.weight_quant
        if wq is not None and (wq.in_forward or self.weight_quantization_enabled):  # type: ignore[attr-defined]
            self.weight.data = wq.baked(self.weight, self._weight_groups())
        self.weight_quant = None

    # --- activation quantization ---
    def enable_activation_quantization(self, bits: int, quantization_type: str, range_calibration: str) -> None:
        if bits not in (4, 8):
            raise ValueError(f"activation quantization supports 4 and 8 bits, got {bits}")
        static = QuantAct(quant_mode=quantization_type) if range_calibration == "static" else None
        self._act_quant = (bits, quantization_type == "symmetric", static)
        if static is not None:
            self.activation_quantizer = static  # a submodule: its ranges are a buffer of the model
        self.activation_quantization_method = f"{quantization_type}_{range_calibration}"

    def _quantized_input(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        if self._act_quant is None or not self.activation_quantization_enabled:  # type: ignore[attr-defined]
            return x
        bits, symmetric, static = self._act_quant
        if static is not None:
            return static(x, bits)
        return fake_quant(x, QuantSpec(bits, symmetric, groups))

    # --- sparse pruning ---
    def enable_sparse_pruning(self, ratio: float, method: str) -> None:
        self.sparse_pruning_ratio, self.sparse_pruning_method = ratio, method
        self._enable_mask("sparse", ratio, method, tuple(self.weight.shape))

    def _enable_mask(self, unit: str, ratio: float, method: str, score_shape: tuple[int, ...]) -> None:
        mask = None
        if method == "l1":
            mask = masks.topk_mask(masks.l1_scores(self.weight, unit), ratio).reshape(score_shape)
        elif method == "topk":
            setattr(self, f"{unit}_mask_scores", masks.new_scores(score_shape, self.weight.device))
        else:
            raise ValueError(f"{unit} pruning method {method!r}: expected 'l1' or 'topk'")
        self.register_buffer(f"{unit}_pruning_mask", mask)  # type: ignore[attr-defined]

    def get_mask(self, pruning_type: str = "row") -> torch.Tensor:
        method = getattr(self, f"{pruning_type}_pruning_method")
        ratio = getattr(self, f"{pruning_type}_pruning_ratio")
        if method == "l1":  # a buffer: it may keep fp32 in an fp16/bf16 model
            return getattr(self, f"{pruning_type}_pruning_mask").to(self.weight.dtype)  # type: ignore[no-any-return]
        if method == "topk":
            scores = self.head_pruning_scores if pruning_type == "head" else getattr(self, f"{pruning_type}_mask_scores")
            return masks.learned_mask(scores, ratio).to(self.weight.dtype)
        raise ValueError(f"{pruning_type} pruning is not enabled on this layer")

    def _drop_mask(self, unit: str) -> None:
        for name in (f"{unit}_pruning_mask", f"{unit}_mask_scores", "head_pruning_scores" if unit == "head" else ""):
            if name and hasattr(self, name):
                delattr(self, name)
        setattr(self, f"{unit}_pruning_method", None)
        setattr(self, f"{unit}_pruning_enabled", False)

    def _sparse(self, weight: torch.Tensor) -> torch.Tensor:
        if self.sparse_pruning_enabled and self.sparse_pruning_method:  # type: ignore[attr-defined]
            return weight * self.get_mask("sparse").reshape(weight.shape)
        return weight

    def fix_sparse_pruning_helper(self) -> None:
        if self.sparse_pruning_method:
            self.weight.data = self.weight.data * self.get_mask("sparse").detach().reshape(self.weight.shape)
        self._drop_mask("sparse")


class _LinearCompressed(_Compressed):
    """A linear's techniques (``LinearLayer_Compress`` and its tensor-parallel twins, ``tensor_parallel.py``)."""

    in_features: int
    out_features: int
    bias: nn.Parameter | None
    num_heads: int

    def enable_row_pruning(self, ratio: float, method: str) -> None:
        self.row_pruning_ratio, self.row_pruning_method = ratio, method
        self._enable_mask("row", ratio, method, (self.out_features, 1))

    def enable_head_pruning(self, ratio: float, method: str, num_heads: int) -> None:
        if method != "topk":
            raise ValueError(f"head pruning method {method!r}: only 'topk' (as in DeepSpeed 0.19.6)")
        if self.in_features % num_heads:
            raise ValueError(f"in_features {self.in_features} is not divisible by num_heads {num_heads}")
        self.num_heads, self.head_pruning_ratio, self.head_pruning_method = num_heads, ratio, method
        self.head_pruning_scores = masks.new_scores((1, num_heads), self.weight.device)

    def compressed_weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward's weight and bias: quantized, times the sparse mask, times the row mask (weight rows and
        bias), the pruned heads' input columns zeroed."""
        weight, bias = self._sparse(self._quantized_weight()), self.bias
        if self.row_pruning_enabled and self.row_pruning_method:  # type: ignore[attr-defined]
            mask = self.get_mask("row")
            weight = weight * mask.reshape(-1, 1)
            bias = None if bias is None else bias * mask.reshape(-1)
        if self.head_pruning_enabled and self.head_pruning_method:  # type: ignore[attr-defined]
            weight = masks.head_mask_columns(weight, self.get_mask("head"), self.num_heads)
        return weight, bias


class LinearLayer_Compress(_LinearCompressed, nn.Linear):  # noqa: N801 - DeepSpeed's name
    """``nn.Linear`` with weight/activation quantization and sparse, row and head pruning."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: Any = None) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_compression()

    def tensor_parallel_twin(self, kind: str, fused: bool) -> type[nn.Module] | None:
        """The tensor-parallel layer AutoTP builds from this one (``parallel/tensor/layer.HasParallelTwin``)."""
        from .tensor_parallel import parallel_twin

        return parallel_twin(self, kind, fused)

    def forward(self, input: torch.Tensor, skip_bias_add: bool = False) -> Any:  # noqa: A002 - torch's name
        weight, bias = self.compressed_weight_and_bias()
        x = self._quantized_input(input, input.numel() // input.size(-1))
        if skip_bias_add:
            return F.linear(x, weight), bias
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        wq = None if self.weight_quant is None else self.weight_quant.target_bits
        return (f"{super().extra_repr()}, sparse pruning={self.sparse_pruning_method is not None}, row pruning="
                f"{self.row_pruning_method is not None}, head pruning={self.head_pruning_method is not None}, "
                f"activation quantization={self.activation_quantization_method is not None}, "
                f"weight_quantization={wq}")


class Conv2dLayer_Compress(_Compressed, nn.Conv2d):  # noqa: N801 - DeepSpeed's name
    """``nn.Conv2d`` with weight/activation quantization and sparse and channel (output filter) pruning."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        nn.Conv2d.__init__(self, *args, **kwargs)
        self._init_compression()

    def enable_channel_pruning(self, ratio: float, method: str) -> None:
        self.channel_pruning_ratio, self.channel_pruning_method = ratio, method
        self._enable_mask("channel", ratio, method, (self.out_channels, 1, 1, 1))

    def enable_weight_quantization(self, start_bits: int, target_bits: int, quantization_period: int,
                                   weight_quantization_enabled_in_forward: bool, quantization_type: str,
                                   num_groups: int, rounding: str = "nearest", fp16_mixed: bool = False) -> None:
        if weight_quantization_enabled_in_forward and target_bits < 4:
            raise ValueError(f"convolutions quantize weights in the forward at 4 bits or more, got {target_bits}")
        super().enable_weight_quantization(start_bits, target_bits, quantization_period,
                                           weight_quantization_enabled_in_forward, quantization_type, num_groups,
                                           rounding, fp16_mixed)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        weight, bias = self._sparse(self._quantized_weight()), self.bias
        if self.channel_pruning_enabled and self.channel_pruning_method:  # type: ignore[attr-defined]
            mask = self.get_mask("channel")
            weight = weight * mask.reshape(-1, 1, 1, 1)
            bias = None if bias is None else bias * mask.reshape(-1)
        x = self._quantized_input(input, input.shape[0])  # dynamic ranges: one per sample
        return self._conv_forward(x, weight, bias)


class Embedding_Compress(_Compressed, nn.Embedding):  # noqa: N801 - DeepSpeed's name
    """``nn.Embedding`` with weight quantization (one scale per token's row, as DeepSpeed)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        nn.Embedding.__init__(self, *args, **kwargs)
        self._init_compression()

    def _weight_groups(self) -> int | None:
        wq = self.weight_quant
        return self.weight.shape[0] if wq is not None and wq.in_forward else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        return F.embedding(input, self._quantized_weight(), self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)


class BNLayer_Compress(nn.BatchNorm2d):  # noqa: N801 - DeepSpeed's name
    """``nn.BatchNorm2d`` that follows its convolution's channel pruning (``redundancy_clean``)."""


COMPRESSED_TYPES: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: LinearLayer_Compress, nn.Conv2d: Conv2dLayer_Compress, nn.Embedding: Embedding_Compress,
    nn.BatchNorm2d: BNLayer_Compress,
}
