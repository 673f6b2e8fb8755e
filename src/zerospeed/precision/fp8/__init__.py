"""FP8 training of linear layers (the ``fp8`` config section): dynamic per-tensor scaling, e4m3/e5m2."""

from .convert import convert_to_float8, fp8_candidates, has_fp8_tensor_cores, resolve_backend
from .linear import Float8Linear, reference_linear
from .scaling import E4M3, E5M2, from_fp8, to_fp8

__all__ = ["E4M3", "E5M2", "Float8Linear", "convert_to_float8", "fp8_candidates", "from_fp8",
           "has_fp8_tensor_cores", "reference_linear", "resolve_backend", "to_fp8"]
