"""DeepSpeed's ``op_builder`` classes, answering for zerospeed: which of DeepSpeed's compiled ops it covers.

zerospeed builds no C++/CUDA extensions. A builder is *compatible* when zerospeed has its own code for
that op (``IMPLEMENTED_BY``: e.g. ``cpu_adam`` is ``zerospeed.offload.cpu_adam``); ``load()`` then
returns that module. Every other builder answers ``is_compatible() == False`` and ``load()`` raises an
error naming the op, so a script that checks compatibility first takes its fallback path.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# DeepSpeed op name -> the zerospeed module that implements it (absent: not implemented)
IMPLEMENTED_BY: dict[str, str] = {
    "cpu_adam": "zerospeed.offload.cpu_adam",
    "cpu_adagrad": "zerospeed.optim.named",
    "fused_adam": "zerospeed.optim.named",
    "fused_lamb": "zerospeed.optim.named",
    "sparse_attn": "zerospeed.sparse_attention",
    "random_ltd": "zerospeed.data_pipeline.random_ltd",
}


class OpBuilder:
    """One DeepSpeed op: ``NAME``, ``is_compatible()``, ``load()`` (DeepSpeed's builder interface)."""

    NAME = "deepspeed_not_implemented"

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.name}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        return self.name in IMPLEMENTED_BY

    def load(self, verbose: bool = True) -> ModuleType:
        target = IMPLEMENTED_BY.get(self.name)
        if target is None:
            raise NotImplementedError(f"DeepSpeed op {self.name!r} ({type(self).__name__}) is not implemented "
                                      "by zerospeed, which builds no C++/CUDA extensions")
        return importlib.import_module(target)

    def builder(self) -> None:
        raise NotImplementedError(f"zerospeed builds no extension for {self.name!r}; use load()")


def _builder(class_name: str, op_name: str) -> type[OpBuilder]:
    return type(class_name, (OpBuilder,), {"NAME": op_name, "__doc__": f"DeepSpeed's ``{op_name}`` op builder."})


_BUILDERS = {
    "AsyncIOBuilder": "async_io", "CCLCommBuilder": "deepspeed_ccl_comm", "CPUAdagradBuilder": "cpu_adagrad",
    "CPUAdamBuilder": "cpu_adam", "CPULionBuilder": "cpu_lion", "DeepCompileBuilder": "dc",
    "EvoformerAttnBuilder": "evoformer_attn", "FPQuantizerBuilder": "fp_quantizer",
    "FlashAttentionBuilder": "flash_attn", "FusedAdamBuilder": "fused_adam", "FusedLambBuilder": "fused_lamb",
    "FusedLionBuilder": "fused_lion", "GDSBuilder": "gds", "InferenceBuilder": "transformer_inference",
    "InferenceCoreBuilder": "inference_core_ops", "InferenceCutlassBuilder": "cuda_linear",
    "NotImplementedBuilder": "deepspeed_not_implemented", "PinMemoryBuilder": "pin_memory",
    "QuantizerBuilder": "quantizer", "RaggedOpsBuilder": "ragged_device_ops", "RaggedUtilsBuilder": "ragged_ops",
    "RandomLTDBuilder": "random_ltd", "ShareMemCommBuilder": "deepspeed_shm_comm",
    "SparseAttnBuilder": "sparse_attn", "SpatialInferenceBuilder": "spatial_inference",
    "StochasticTransformerBuilder": "stochastic_transformer", "TransformerBuilder": "transformer",
    "UtilsBuilder": "utils",
}
for _cls, _op in _BUILDERS.items():
    globals()[_cls] = _builder(_cls, _op)

ALL_OPS: dict[str, OpBuilder] = {op: globals()[cls]() for cls, op in _BUILDERS.items()}
__compatible_ops__: dict[str, bool] = {op: b.is_compatible() for op, b in ALL_OPS.items()}
__all__ = ["OpBuilder", "ALL_OPS", "__compatible_ops__", *_BUILDERS]
