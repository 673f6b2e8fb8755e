"""``ZeroSpeedFabricStrategy``: Lightning Fabric (``Fabric(strategy="zerospeed_stage_2")``) through zerospeed.

``fabric.setup(model, optimizer)`` returns the engine (wrapped by Fabric); ``fabric.backward(loss)`` and
``optimizer.step()`` go through the engine's backward and step (accumulation, clipping and loss scaling from
the config); ``fabric.save`` / ``fabric.load`` write and read zerospeed checkpoints with the rest of the state
as client state, as Fabric's DeepSpeed strategy does.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.utilities.apply_func import apply_to_collection

import zerospeed

from . import config as cfgs
from .strategy import _jsonable

_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16,
           "16-true": torch.float16, "32-true": torch.float32}


class ZeroSpeedFabricPrecision(Precision):
    """Backward through the engine; inputs cast to the compute dtype."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in _DTYPES:
            raise ValueError(f"precision {precision!r} is not supported with zerospeed; one of {sorted(_DTYPES)}")
        self.precision = precision  # type: ignore[assignment]
        self.dtype = _DTYPES[precision]

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(self.dtype) if t.is_floating_point() else t)

    def convert_output(self, data: Any) -> Any:
        default = torch.get_default_dtype()
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(default) if t.is_floating_point() else t)

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        model.backward(tensor, *args, **kwargs)


class ZeroSpeedFabricStrategy(DDPStrategy):
    def __init__(self, accelerator: Any = None, stage: int = 2, offload_optimizer: bool = False,
                 offload_parameters: bool = False, config: str | dict[str, Any] | None = None,
                 parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None,
                 precision: Precision | None = None, process_group_backend: str | None = None,
                 exclude_frozen_parameters: bool = False) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision,
                         process_group_backend=process_group_backend)
        loaded = cfgs.load(config)
        if loaded is None:
            loaded = cfgs.default(stage, offload_optimizer, offload_parameters, "cpu", "cpu", "/local_nvme", 1, True, {})
        loaded.setdefault("train_micro_batch_size_per_gpu", 1)
        self.config: dict[str, Any] = loaded
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self._engine: Any = None

    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else ZeroSpeedFabricPrecision()

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, ZeroSpeedFabricPrecision):
            name = str(getattr(plugin, "precision", "32-true"))
            plugin = ZeroSpeedFabricPrecision({"32": "32-true", "16": "16-mixed"}.get(name, name))
        self._precision = plugin

    @property
    def zero_stage_3(self) -> bool:
        return int((self.config.get("zero_optimization") or {}).get("stage", 0)) == 3

    @property
    def model(self) -> Any:
        return self._engine

    def _setup_distributed(self) -> None:
        self._set_world_ranks()
        env = self.cluster_environment
        assert env is not None
        for key, value in (("MASTER_ADDR", env.main_address), ("MASTER_PORT", env.main_port), ("RANK", self.global_rank),
                           ("WORLD_SIZE", self.world_size), ("LOCAL_RANK", self.local_rank)):
            os.environ.setdefault(key, str(value))
        self._process_group_backend = self._get_process_group_backend()
        zerospeed.init_distributed(dist_backend=self._process_group_backend)
        precision = self.precision.precision
        cfgs.complete(self.config, int(self.config.get("gradient_accumulation_steps", 1)),
                      self.config["train_micro_batch_size_per_gpu"], None, precision, {})

    def _initialize(self, module: torch.nn.Module, optimizer: Any = None, scheduler: Any = None) -> tuple[Any, Any, Any]:
        trainable = [p for p in module.parameters() if p.requires_grad]
        engine, zero_opt, _, sched = zerospeed.initialize(model=module, model_parameters=trainable, optimizer=optimizer,
                                                          lr_scheduler=scheduler, config=self.config,
                                                          dist_init_required=False)
        self._engine = engine
        return engine, zero_opt, sched

    def setup_module_and_optimizers(self, module: torch.nn.Module, optimizers: list[Any], scheduler: Any = None
                                    ) -> tuple[Any, list[Any], Any]:
        if len(optimizers) != 1:
            raise ValueError(f"zerospeed trains with one optimizer per model, got {len(optimizers)}")
        engine, zero_opt, sched = self._initialize(module, optimizers[0], scheduler)
        return engine, [zero_opt], sched

    def setup_module(self, module: torch.nn.Module) -> Any:
        engine, _, _ = self._initialize(module)
        return engine

    def setup_optimizer(self, optimizer: Any) -> Any:
        raise NotImplementedError(self._err_msg_joint_setup_required())

    def module_to_device(self, module: torch.nn.Module) -> None:
        return None  # the engine places the model

    def module_sharded_context(self) -> AbstractContextManager:
        if not self.zero_stage_3:
            return nullcontext()
        from zerospeed.zero import Init

        return Init(config_dict_or_path=self.config)

    def backward(self, tensor: torch.Tensor, module: Any, *args: Any, **kwargs: Any) -> None:
        """``fabric.backward(loss)``: the engine's backward (the one set up, or the one ``model=`` names)."""
        engine = module if isinstance(module, zerospeed.Engine) else self._engine
        if engine is None:
            raise RuntimeError("no model was set up: call fabric.setup(model, optimizer) first")
        self.precision.backward(tensor, engine, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` in a Fabric loop: the engine's step (applied at the accumulation boundary)."""
        return self._engine.step(**kwargs)

    def clip_gradients_norm(self, module: Any, optimizer: Any, max_norm: float, norm_type: float = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        raise NotImplementedError("zerospeed clips gradients in the engine: set \"gradient_clipping\" in the config")

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: Any = None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError("ZeroSpeedFabricStrategy.save_checkpoint takes no storage_options or filter")
        engine = self._engine_in(state)
        path = self.broadcast(str(path))
        rest = {k: v for k, v in state.items() if v is not engine and v is not engine.optimizer}
        rest = self._convert_stateful_objects_in_state(rest, filter={})
        engine.save_checkpoint(path, tag="checkpoint", client_state=_jsonable(rest),
                               exclude_frozen_parameters=self.exclude_frozen_parameters)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if not isinstance(state, dict) or not state:
            raise ValueError("load_checkpoint(path, state={'model': model, ...}) needs the state holding the model")
        engine = self._engine_in(state)
        wants_optimizer = any(v is engine.optimizer for v in state.values())
        loaded, client = engine.load_checkpoint(str(path), tag="checkpoint", load_optimizer_states=wants_optimizer,
                                                load_lr_scheduler_states=False, load_module_strict=strict)
        if loaded is None or client is None:
            raise FileNotFoundError(f"{path} holds no zerospeed checkpoint (saved by ZeroSpeedFabricStrategy)")
        for key in set(client) & set(state):
            target = state[key]
            if hasattr(target, "load_state_dict") and target is not engine and target is not engine.optimizer:
                target.load_state_dict(client.pop(key))
            elif not hasattr(target, "load_state_dict"):
                state[key] = client.pop(key)
        return client

    def _engine_in(self, state: dict[str, Any]) -> Any:
        from lightning.fabric.wrappers import _unwrap_objects

        engines = [v for v in _unwrap_objects(state).values() if isinstance(v, zerospeed.Engine)]
        if len(engines) != 1:
            raise ValueError(f"the state must hold exactly one model set up by fabric.setup; found {len(engines)}")
        return engines[0]

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("zerospeed", cls, description="zerospeed (ZeRO stage 2 by default)")
        for stage in (0, 1, 2, 3):
            strategy_registry.register(f"zerospeed_stage_{stage}", cls, description=f"zerospeed ZeRO stage {stage}",
                                       stage=stage)
