"""``ZeroSpeedStrategy``: Lightning's Trainer trains through a zerospeed engine (ZeRO 0-3, offload).

It follows Lightning's ``DeepSpeedStrategy`` (same constructor names, strategy names ``zerospeed``,
``zerospeed_stage_{1,2,3}``, ``..._offload``), with zerospeed underneath: ``initialize()`` builds the engine
from the LightningModule and the optimizer of ``configure_optimizers`` (Lightning keeps stepping the LR
scheduler); backward and step go through the engine (``ZeroSpeedPrecision``); checkpoints are zerospeed
checkpoints (a directory per ``.ckpt`` path) holding Lightning's loop and callback state as client state.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import LRSchedulerConfig

import zerospeed
from zerospeed.config import NotSupportedYetError

from . import config as cfgs
from .precision import ZeroSpeedPrecision


class ZeroSpeedStrategy(DDPStrategy):
    strategy_name = "zerospeed"

    def __init__(self, accelerator: Any = None, zero_optimization: bool = True, stage: int = 2,
                 offload_optimizer: bool = False, offload_parameters: bool = False,
                 offload_params_device: str = "cpu", offload_optimizer_device: str = "cpu",
                 nvme_path: str = "/local_nvme", contiguous_gradients: bool = True, overlap_comm: bool = True,
                 allgather_bucket_size: int = 200_000_000, reduce_bucket_size: int = 200_000_000,
                 zero_allow_untested_optimizer: bool = True, logging_batch_size_per_gpu: int | str = "auto",
                 config: str | dict[str, Any] | None = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: Any = None, loss_scale: float = 0, initial_scale_power: int = 16,
                 loss_scale_window: int = 1000, hysteresis: int = 2, min_loss_scale: int = 1,
                 load_full_weights: bool = False, exclude_frozen_parameters: bool = False,
                 process_group_backend: str | None = None, precision_plugin: Precision | None = None,
                 remote_device: str | None = None) -> None:
        if load_full_weights:
            raise NotSupportedYetError("load_full_weights", "ZeroSpeedStrategy(load_full_weights=True) is not supported "
                                       "yet: load a zerospeed checkpoint directory, or the weights before fit()")
        if remote_device not in (None, "cpu"):
            raise NotSupportedYetError("remote_device", f"remote_device={remote_device!r} is not supported yet")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend)
        loaded = cfgs.load(config)
        if loaded is None:
            zero_kwargs = {"contiguous_gradients": contiguous_gradients, "overlap_comm": overlap_comm,
                           "allgather_bucket_size": allgather_bucket_size, "reduce_bucket_size": reduce_bucket_size}
            loaded = cfgs.default(stage if zero_optimization else 0, offload_optimizer, offload_parameters,
                                  offload_optimizer_device, offload_params_device, nvme_path,
                                  logging_batch_size_per_gpu, zero_allow_untested_optimizer, zero_kwargs)
        self.config: dict[str, Any] = loaded
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self.remote_device = remote_device
        self._fp16_options = {"loss_scale": loss_scale, "initial_scale_power": initial_scale_power,
                              "loss_scale_window": loss_scale_window, "hysteresis": hysteresis,
                              "min_loss_scale": min_loss_scale}
        self._config_done = False

    # --- precision: whatever Lightning picks from Trainer(precision=...) runs through the engine -------------
    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else ZeroSpeedPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, ZeroSpeedPrecision):
            plugin = ZeroSpeedPrecision(getattr(plugin, "precision", "32-true"))
        self._precision_plugin = plugin

    # --- processes -----------------------------------------------------------------------------------
    def setup_distributed(self) -> None:
        """Join the job through zerospeed (a no-op when the process group already exists)."""
        self.set_world_ranks()
        env = self.cluster_environment
        assert env is not None
        os.environ.setdefault("MASTER_ADDR", env.main_address)
        os.environ.setdefault("MASTER_PORT", str(env.main_port))
        os.environ.setdefault("RANK", str(self.global_rank))
        os.environ.setdefault("WORLD_SIZE", str(self.world_size))
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank))
        self._process_group_backend = self._get_process_group_backend()
        zerospeed.init_distributed(dist_backend=self._process_group_backend)

    @property
    def zero_stage_3(self) -> bool:
        return int((self.config.get("zero_optimization") or {}).get("stage", 0)) == 3

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's checkpoint holds the optimizer state

    @property
    def engine(self) -> Any:
        return self.model

    deepspeed_engine = engine  # the name Lightning users reach for

    # --- building the engine -------------------------------------------------------------------------
    def _complete_config(self) -> None:
        if self._config_done or self.lightning_module is None:
            return
        trainer = self.lightning_module.trainer
        cfgs.complete(self.config, trainer.accumulate_grad_batches, self._batch_size(trainer),
                      trainer.gradient_clip_val, self.precision_plugin.precision, self._fp16_options)
        if trainer.gradient_clip_algorithm not in (None, "norm") and trainer.gradient_clip_val:
            raise ValueError("zerospeed clips gradients by norm only (gradient_clip_algorithm='norm')")
        self._config_done = True

    @staticmethod
    def _batch_size(trainer: Any) -> int | None:
        source = trainer.fit_loop._data_source
        if source.is_defined():
            loader = source.dataloader()
            sampler = getattr(loader, "batch_sampler", None)
            return getattr(sampler, "batch_size", None) or getattr(loader, "batch_size", None)
        return None

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self._complete_config()
        self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            self._init_engine()
        else:
            self._init_engine(inference=True)
        self.barrier()

    def setup_optimizers(self, trainer: Any) -> None:
        self.optimizers, self.lr_scheduler_configs = [], []  # the engine builds them in _init_engine

    def _init_engine(self, inference: bool = False) -> None:
        module = self.lightning_module
        assert module is not None
        optimizer, scheduler_cfg = None, None
        if not inference and "optimizer" not in self.config:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise ValueError("zerospeed trains with one optimizer and at most one LR scheduler; "
                                 f"configure_optimizers returned {len(optimizers)} and {len(schedulers)}")
            optimizer, scheduler_cfg = optimizers[0], (schedulers[0] if schedulers else None)
        trainable = [p for p in module.parameters() if p.requires_grad]
        engine, zero_opt, _, engine_sched = zerospeed.initialize(
            model=module, model_parameters=trainable, optimizer=optimizer, config=self.config,
            dist_init_required=False)
        if engine_sched is not None:  # a config scheduler: Lightning steps it (per optimizer step)
            engine.lr_scheduler = None
            if scheduler_cfg is None:
                scheduler_cfg = LRSchedulerConfig(engine_sched, interval="step")
        self.model = engine
        self.optimizers = [zero_opt] if zero_opt is not None else []
        self.lr_scheduler_configs = [scheduler_cfg] if scheduler_cfg is not None else []

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:  # type: ignore[override]
        return model

    def model_to_device(self) -> None:
        return None  # the engine places the model (and partitions it under ZeRO-3)

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` runs inside ``zerospeed.zero.Init`` under ZeRO-3: parameters are partitioned as
        they are created, no rank ever holds the whole model."""
        if not self.zero_stage_3:
            yield
            return
        from zerospeed.zero import Init

        with Init(config_dict_or_path=self.config):
            yield

    # --- checkpoints ---------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the module's state is in the engine's checkpoint

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Collective: a zerospeed checkpoint directory at ``filepath``; Lightning's own state as client state."""
        if storage_options is not None:
            raise TypeError("storage_options is not supported by ZeroSpeedStrategy (no CheckpointIO is used)")
        filepath = self.broadcast(str(filepath))
        client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, tag="checkpoint", client_state=_jsonable(client),
                                    exclude_frozen_parameters=self.exclude_frozen_parameters)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        path, client = self.engine.load_checkpoint(str(checkpoint_path), tag="checkpoint",
                                                   load_optimizer_states=fitting, load_lr_scheduler_states=False,
                                                   load_module_strict=module.strict_loading)
        if path is None or client is None:
            raise FileNotFoundError(f"{checkpoint_path} holds no zerospeed checkpoint (saved by ZeroSpeedStrategy)")
        return client  # Lightning restores the LR schedulers from client["lr_schedulers"] itself

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        return None  # loaded by the engine in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        return None

    def teardown(self) -> None:
        """The engine stays the strategy's model (``trainer.save_checkpoint`` after ``fit`` still works, as
        with DeepSpeed); pending async checkpoint writes are finished."""
        engine = self.model
        if isinstance(engine, zerospeed.Engine):
            engine.wait_for_checkpoint()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("zerospeed", cls, description="zerospeed (ZeRO stage 2 by default)")
        for stage in (0, 1, 2, 3):
            strategy_registry.register(f"zerospeed_stage_{stage}", cls, description=f"zerospeed ZeRO stage {stage}",
                                       stage=stage)
        strategy_registry.register("zerospeed_stage_2_offload", cls, description="zerospeed ZeRO-2 + CPU offload",
                                   stage=2, offload_optimizer=True)
        strategy_registry.register("zerospeed_stage_3_offload", cls, description="zerospeed ZeRO-3 + CPU offload",
                                   stage=3, offload_optimizer=True, offload_parameters=True)


def _jsonable(obj: Any) -> Any:
    """Lightning's checkpoint extras as JSON and tensors (zerospeed checkpoints hold no pickles): containers
    kept, non-string keys and unknown objects turned into their string form."""
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return obj
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return obj.item()
    return str(obj)
