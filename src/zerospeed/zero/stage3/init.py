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
from .param_store import partition, shard_of


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

    @torch.no_grad()
    def _cut(self, module: nn.Module) -> None:
        for p in module.parameters():
            if shard_of(p) is not None or p.numel() <= self.threshold or (self.world == 1 and self.home is None):
                continue
            self._whole_bytes[id(p)] = p.numel() * p.element_size()
            self._account()
            target = self.dtype if p.is_floating_point() else p.dtype
            p.data = p.data.to(device=self.device or p.device, dtype=target)
            comm.broadcast(p.data, src=0, group=self.group)
            state = partition(p, self.group, persistent=False)
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
