"""A ZeRO-3 partition kept quantized (``weight_quantization.quantized_initialization``): codes and scales.

Under ``zero.Init`` with the key, each ``nn.Linear`` / ``nn.Embedding`` weight is quantized the moment it is
cut (DeepSpeed's asymmetric groups, ``inference/group_quant.py``) and its ZeRO-3 shard holds bytes, not floats:
the parameter's *packed* value, one flat ``uint8`` tensor laid out as::

    [ step: G x fp32 | minimum: G x fp32 | codes: n bytes (INT8) or n / 2 (INT4, two per byte) ]

(``G`` groups, ``n`` elements). The packed value is cut like any parameter: rank ``r`` owns bytes
``[r*s, (r+1)*s)`` with ``s = ceil(P / N)`` (``P`` packed bytes), so a shard takes ``P / N`` bytes instead of
``4 n / N`` (fp32). A gather all-gathers the packed shards (one collective of bytes) and the fetcher
*decodes* them: the full float value (the gathered parameter) is the dequantized weight, so the module's
own forward (``F.linear``, ``F.embedding``) runs unchanged on it; nothing is patched. A new full value (a
``GatheredParameters`` block with a modifier, a parent re-initialising the weight inside ``zero.Init``, a
state dict loaded there) is quantized again when it is written back, as DeepSpeed's wrapped
``_load_from_state_dict`` does. The weight is frozen (``requires_grad`` False): its shard holds codes, which
an optimizer step cannot update.
"""

from __future__ import annotations

import torch

from ...inference.group_quant import GroupSpec, check_shape, dequantize_groups, quantize_groups
from ...inference.quantization import PackedWeight


class WeightCodec:
    """Encodes a weight of ``shape`` to its packed bytes and decodes them to ``dtype`` (module docstring)."""

    def __init__(self, spec: GroupSpec, shape: torch.Size, dtype: torch.dtype, what: str = "weight") -> None:
        check_shape(shape, spec, what)
        self.spec, self.shape, self.dtype = spec, torch.Size(shape), dtype
        numel = self.shape.numel()
        self.cols = self.shape[spec.group_dim]
        self.rows = numel // self.cols
        self.groups = numel // spec.group_size
        self.scale_bytes = 2 * 4 * self.groups  # step and minimum, fp32
        self.code_bytes = numel if spec.num_bits == 8 else numel // 2
        self.nbytes = self.scale_bytes + self.code_bytes

    def encode(self, full: torch.Tensor) -> torch.Tensor:
        """The packed bytes (flat ``uint8``, ``nbytes``) of the full value ``full``."""
        packed = quantize_groups(full.reshape(self.shape), self.spec)
        return torch.cat([packed.scale.reshape(-1).view(torch.uint8), packed.offset.reshape(-1).view(torch.uint8),
                          packed.codes.reshape(-1).view(torch.uint8)])

    def decode(self, packed: torch.Tensor, out: torch.Tensor) -> None:
        """Write the dequantized weight (``out``: flat, ``shape.numel()`` elements of ``dtype``) from ``packed``."""
        g = self.groups
        scales = packed[: self.scale_bytes].view(torch.float32)
        codes = packed[self.scale_bytes: self.nbytes]
        per_row = self.cols if self.spec.num_bits == 8 else self.cols // 2
        codes = (codes.view(torch.int8) if self.spec.num_bits == 8 else codes).view(self.rows, per_row)
        weight = PackedWeight(codes, scales[:g].view(self.rows, -1), scales[g:].view(self.rows, -1),
                              self.spec.num_bits, self.rows, self.cols)
        out.copy_(dequantize_groups(weight, self.shape, self.spec.group_dim, out.dtype).reshape(-1))

    def __repr__(self) -> str:
        s = self.spec
        return f"WeightCodec(int{s.num_bits}, groups of {s.group_size} along dim {s.group_dim}, {self.nbytes} bytes)"
