"""Swapping a model's layers for compression-aware ones (DeepSpeed's ``deepspeed.compression.helper`` names).

A swapped layer keeps the very parameter objects of the old one, so tied weights (a GPT's embedding and LM
head) stay one tensor and an optimizer built before the swap still holds the model's parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..compat.compression_helper import recursive_getattr, recursive_setattr
from ..config.errors import NotSupportedYetError
from .layers import COMPRESSED_TYPES, BNLayer_Compress, _Compressed

COMPRESSIBLE = tuple(COMPRESSED_TYPES)


def is_module_compressible(module: nn.Module, mpu: Any = None) -> bool:
    """A Linear, Conv2d, Embedding or BatchNorm2d (DeepSpeed's list), or a compression-aware AutoTP layer
    (``tensor_parallel.py``; Megatron ``mpu`` layers: not yet)."""
    return isinstance(module, (*COMPRESSIBLE, _Compressed))


def _compressed_type(module: nn.Module) -> type[nn.Module] | None:
    for base, compressed in COMPRESSED_TYPES.items():
        if isinstance(module, compressed):
            return None  # already compression-aware
        if isinstance(module, base):
            return compressed
    return None


def _blank(old: nn.Module, new_type: type[nn.Module]) -> nn.Module:
    """An empty (meta-device) ``new_type`` with ``old``'s hyper-parameters."""
    meta = {"device": "meta"}
    if isinstance(old, nn.Linear):
        return new_type(old.in_features, old.out_features, bias=old.bias is not None, **meta)
    if isinstance(old, nn.Conv2d):
        return new_type(old.in_channels, old.out_channels, old.kernel_size, old.stride, old.padding, old.dilation,
                        old.groups, old.bias is not None, old.padding_mode, **meta)
    if isinstance(old, nn.Embedding):
        return new_type(old.num_embeddings, old.embedding_dim, old.padding_idx, old.max_norm, old.norm_type,
                        old.scale_grad_by_freq, old.sparse, **meta)
    assert isinstance(old, nn.BatchNorm2d)
    return new_type(old.num_features, old.eps, old.momentum, old.affine, old.track_running_stats, **meta)


def compressed_copy(old: nn.Module) -> nn.Module:
    """The compression-aware twin of ``old``, holding its parameter and buffer objects (``old`` if already one)."""
    new_type = _compressed_type(old)
    if new_type is None:
        return old
    new = _blank(old, new_type)
    for name, param in old.named_parameters(recurse=False):
        setattr(new, name, param)
    for name, buf in old.named_buffers(recurse=False):
        new._buffers[name] = buf
    for name in list(new._parameters):
        if name not in old._parameters:
            new._parameters[name] = None  # e.g. no bias
    new.train(old.training)
    return new


def module_replacement(model: nn.Module, module_name: str, compression_technique: Any = None, mpu: Any = None) -> None:
    """Replace ``model.<module_name>`` with its compression-aware twin (techniques: ``compress.enable``)."""
    if mpu is not None:
        raise NotSupportedYetError("compression_training", "compression of tensor-parallel (mpu) layers is not "
                                   "supported yet by zerospeed")
    recursive_setattr(model, module_name, compressed_copy(recursive_getattr(model, module_name)))
    if compression_technique is not None:
        from .apply import enable

        for technique, group in compression_technique.items():
            enable(recursive_getattr(model, module_name), technique, group, module_name)


def compression_preparation(model: nn.Module, compression_technique_list: Any = (), mpu: Any = None) -> nn.Module:
    """Swap every compressible layer of ``model`` (DeepSpeed swaps them all, compressed or not)."""
    for name, module in list(model.named_modules()):
        if name and is_module_compressible(module, mpu):
            module_replacement(model, name, mpu=mpu)
    for names_per_pattern, _, technique in compression_technique_list:
        for names in names_per_pattern:
            for name in names:
                module_replacement(model, name, technique, mpu=mpu)
    return model


def convert_conv1d_to_linear(model: nn.Module, convert_type: type) -> nn.Module:
    """Replace each ``convert_type`` (Hugging Face's GPT-2 ``Conv1D``, weight ``[in, out]``) by an ``nn.Linear``."""
    root = model.module if hasattr(model, "module") else model
    for name, module in list(root.named_modules()):
        if isinstance(module, convert_type):
            w = module.weight.data
            linear = nn.Linear(w.size(0), w.size(1), bias=module.bias is not None, device=w.device, dtype=w.dtype)
            with torch.no_grad():
                linear.weight.copy_(w.t())
                if module.bias is not None:
                    linear.bias.copy_(module.bias.data.reshape(-1))
            recursive_setattr(root, name, linear)
    return model


__all__ = ["compression_preparation", "convert_conv1d_to_linear", "is_module_compressible", "module_replacement",
           "recursive_getattr", "recursive_setattr"]
