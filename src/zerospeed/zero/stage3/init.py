"""``zero.Init``: build a model already partitioned, so it never has to fit whole on one rank.

No torch function is patched. Inside the block a global *module registration* hook (a public PyTorch
hook) sees each submodule at the moment it is attached to its parent, i.e. right after its constructor
(and its weight initialisation) finished. That submodule's parameters, and its children's not yet cut,
are then broadcast from rank 0 (every rank builds the same model) and cut to this rank's shard. What is
still whole when the block exits (the top module's own parameters) is cut then. At any time a rank
holds the shards built so far plus the one submodule being built whole: peak parameter memory is about
``1/N`` of the model plus its largest layer (``peak_param_bytes`` counts it).

Parameters no larger than ``stage3_param_persistence_threshold`` stay whole (``initialize`` broadcasts
them). With ``zero_optimization.offload_param`` in the config (or ``remote_device`` "cpu"/"nvme" matching
it), each shard goes to its home (host memory or a swap file) as soon as it is cut, at world size 1
too: the model is then never whole in memory, only its largest submodule at a time. A parent that
re-initialises an already-cut child's weights (``self.apply(self._init_weights)``, ``nn.init.*``,
``p.data.normal_()``, ``p.data = t``) gets exactly what it would without ``Init``: inside the block such
calls run on the gathered value and the result is cut again (``init_writes``).

With ``weight_quantization.quantized_initialization`` in the config, the weight of every ``nn.Linear`` and
``nn.Embedding`` (those types exactly, as DeepSpeed) is cut quantized whatever its size and the world size:
its shard holds codes and scales, gathers decode it, and it is frozen (``quantized_shard.py``).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from ... import comm
from ...config import load_config
from ...config.errors import NotSupportedYetError
from .init_writes import CutParameterWrites
from .param_store import register, shard_of
from .quantized_shard import WeightCodec


class Init:
    def __init__(self, module: nn.Module | None = None, data_parallel_group: comm.Group | None = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, **unsupported: Any) -> None:
        on = {k: v for k, v in unsupported.items() if v not in (None, False)}
        if on:
            raise NotSupportedYetError(f"zero.Init({sorted(on)[0]})", f"zero.Init arguments {sorted(on)} are not "
                                       "supported yet by zerospeed")
        if remote_device not in (None, "none", "cpu", "nvme") or mpu is not None:
            raise NotSupportedYetError("zero.Init(remote_device/mpu)", f"remote_device {remote_device!r} and mpu "
                                       "are not supported yet by zerospeed")
        self.enabled = enabled
        if not enabled:
            return
        comm.init_distributed()
        self.group = data_parallel_group if data_parallel_group is not None else comm.world_group()
        self.world = comm.get_world_size(self.group)
        cfg = load_config(config_dict_or_path if config_dict_or_path is not None else config or {})
        self.threshold = cfg.zero_optimization.stage3_param_persistence_threshold
        wq = cfg.weight_quantization
        self.quant = wq.initialization_spec() if wq is not None else None  # quantized_initialization groups
        if dtype is None:
            dtype = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else torch.float32
        self.dtype = dtype
        self.device = torch.device("cpu") if remote_device in ("cpu", "nvme") else None
        self.home = self._home(cfg, remote_device)
        self._owners: dict[int, nn.Module] = {}
        self._handles: list[Any] = []
        self._writes = CutParameterWrites()
        self._whole_bytes: dict[int, int] = {}
        self.shard_bytes = 0
        self.peak_param_bytes = 0
        if module is not None:
            self._cut(module)

    def _home(self, cfg: Any, remote_device: str | None) -> Any:
        """The parameter-offload home from the config's ``offload_param`` section, or None."""
        section = cfg.zero_optimization.offload_param
        if remote_device == "nvme" and section.device != "nvme":
            from ...config import ConfigError

            raise ConfigError("zero_optimization.offload_param", "zero.Init(remote_device='nvme') needs the "
                              "config's offload_param section with device 'nvme' and an nvme_path")
        if not section.enabled:
            return None
        from ...offload.param_home import ParamHome

        return ParamHome(section, cfg.aio, comm.get_rank(self.group))

    # --- the hooks ---------------------------------------------------------------------------------
    def _on_module(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        self._owners[id(parent)] = parent
        if child is not None:
            self._cut(child)
        return None

    def _on_param(self, owner: nn.Module, name: str, param: nn.Parameter | None) -> None:
        self._owners[id(owner)] = owner
        if param is not None and shard_of(param) is None:
            self._whole_bytes[id(param)] = param.numel() * param.element_size()
            self._account()
        return None

    def _account(self) -> None:
        self.peak_param_bytes = max(self.peak_param_bytes, self.shard_bytes + sum(self._whole_bytes.values()))

    def _codecs(self, module: nn.Module) -> dict[int, WeightCodec]:
        """``quantized_initialization``: the codec of each ``nn.Linear`` / ``nn.Embedding`` weight not yet cut."""
        if self.quant is None:
            return {}
        return {id(m.weight): WeightCodec(self.quant, m.weight.shape, self.dtype, f"{type(m).__name__} weight "
                                          f"(weight_quantization.quantized_initialization)")
                for m in module.modules() if type(m) in (nn.Linear, nn.Embedding) and shard_of(m.weight) is None}

    @torch.no_grad()
    def _cut(self, module: nn.Module) -> None:
        codecs = self._codecs(module)
        for p in module.parameters():
            codec = codecs.get(id(p))
            if shard_of(p) is not None or codec is None and (p.numel() <= self.threshold
                                                             or (self.world == 1 and self.home is None)):
                continue
            self._whole_bytes[id(p)] = p.numel() * p.element_size()
            self._account()
            target = self.dtype if p.is_floating_point() else p.dtype
            p.data = p.data.to(device=self.device or p.device, dtype=target)
            comm.broadcast(p.data, src=0, group=self.group)
            state = register(p, self.group, persistent=False)
            if codec is not None:
                state.set_codec(codec)
                p.requires_grad_(False)  # the shard holds codes: no optimizer step can update them
            state.cut()
            if self.home is not None:
                self.home.adopt(state)
            self._writes.remember(state)
            self._whole_bytes.pop(id(p), None)
            self.shard_bytes += state.local_bytes()

    # --- context manager ---------------------------------------------------------------------------
    def __enter__(self) -> Init:
        if self.enabled:
            self._handles = [register_module_module_registration_hook(self._on_module),
                             register_module_parameter_registration_hook(self._on_param)]
            self._writes.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.enabled:
            return
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._writes.__exit__(exc_type, exc, tb)
        if exc_type is None:
            roots = list(self._owners.values())
            for m in roots:
                self._cut(m)
        self._owners.clear()
        self._whole_bytes.clear()
