"""Which backend runs FP8 and which linears it converts (the ``fp8`` config section)."""

from __future__ import annotations

import torch
from torch import nn

from ...config.errors import ConfigError, NotSupportedYetError
from ...config.fp8 import Fp8Config
from .linear import Float8Linear

FP8_CAPABILITY = (8, 9)  # Ada; Hopper is 9.0, Blackwell 10.0


def has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def _describe(device: torch.device) -> str:
    if device.type != "cuda":
        return f"'{device.type}'"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def resolve_backend(cfg: Fp8Config, device: torch.device) -> str:
    """The backend that will run, or a clear error naming what is missing."""
    backend = cfg.backend
    if backend == "transformer_engine":
        raise NotSupportedYetError("fp8.backend", "Transformer Engine FP8 is not supported yet by zerospeed; use "
                                   "'native' (torch._scaled_mm) or 'torchao'")
    if backend == "torchao":
        try:
            import torchao.float8  # noqa: F401, PLC0415
        except ImportError as e:
            raise ConfigError("fp8.backend", f"backend 'torchao' needs torchao ({e}); pip install torchao, or use "
                              "'native'") from None
        return backend
    if backend in ("auto", "native") and device.type == "cuda" and not has_fp8_tensor_cores(device):
        raise ConfigError("fp8", f"FP8 training needs a GPU with FP8 tensor cores (compute capability 8.9+: Ada, "
                          f"Hopper, Blackwell); this device is {_describe(device)}. Use bf16, or fp8.backend "
                          "'emulated' to run the FP8 numerics in fp32")
    if backend == "auto":
        if device.type != "cuda":
            raise ConfigError("fp8", f"FP8 training needs a GPU with FP8 tensor cores; this run's device is "
                              f"{_describe(device)}. Set fp8.backend to 'emulated' to run the FP8 numerics in fp32 "
                              "(tests, CPU), or 'native' for PyTorch's CPU FP8 kernel (slow)")
        return "native"
    return backend


def _skipped(name: str, skip: list[str]) -> bool:
    return any(name == s or name.endswith("." + s) for s in skip)


def fp8_candidates(model: nn.Module, cfg: Fp8Config) -> list[str]:
    """Names of the plain ``nn.Linear`` modules to convert: not skipped, both sizes multiples of 16 and at
    least ``min_features`` (FP8 GEMMs need multiples of 16)."""
    names = []
    for name, m in model.named_modules():
        if type(m) is not nn.Linear or _skipped(name, cfg.skip_modules):
            continue
        dims = (m.in_features, m.out_features)
        if all(d % 16 == 0 and d >= cfg.min_features for d in dims):
            names.append(name)
    return names


def convert_to_float8(model: nn.Module, cfg: Fp8Config, device: torch.device) -> list[str]:
    """Convert ``model``'s eligible linears in place for ``cfg.backend``; returns their names."""
    backend = resolve_backend(cfg, device)
    names = fp8_candidates(model, cfg)
    if not names:
        raise ConfigError("fp8", "fp8 is enabled but the model has no nn.Linear to convert (all are skipped by "
                          f"skip_modules {cfg.skip_modules} or have a size that is not a multiple of 16 and at "
                          f"least min_features {cfg.min_features})")
    if backend == "torchao":
        from torchao.float8 import convert_to_float8_training  # noqa: PLC0415

        chosen = set(names)
        convert_to_float8_training(model, module_filter_fn=lambda _m, fqn: fqn in chosen)
        return names
    modules = dict(model.named_modules())
    for name in names:
        m = modules[name]
        m.__class__ = Float8Linear
        m.fp8_native = backend == "native"  # type: ignore[assignment]
    return names
