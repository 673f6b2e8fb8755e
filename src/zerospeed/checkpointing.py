"""Activation checkpointing, DeepSpeed's ``deepspeed.checkpointing`` API: keep a region's inputs, recompute the rest.

``checkpoint(fn, *args)`` runs ``fn`` once under saved-tensor hooks that store *nothing*: each tensor autograd
would save becomes an index. The first time backward asks for one, ``fn`` is run again on the region's
inputs (same CPU/device RNG state, same autocast state, same model-parallel RNG tracker state) and the
tensors it saves, in the same order, are handed out by index. Dropout therefore draws the same mask twice,
and losses and gradients are bitwise equal to running without checkpointing.

Options (the ``activation_checkpointing`` config section):

* ``cpu_checkpointing``: region inputs are held in host memory and copied back for the recompute.
* ``partition_activations``: split held inputs across the model-parallel group. zerospeed has no tensor
  parallelism yet, so at model-parallel size 1 this is a no-op and a larger group raises ``NotImplementedError``.
* ``contiguous_memory_optimization`` (needs ``partition_activations`` and ``number_checkpoints``, as in
  DeepSpeed): held inputs are stored as contiguous tensors, for at most ``number_checkpoints`` regions
  awaiting backward at once (DeepSpeed's buffer count; one more is an error naming the key).
* ``synchronize_checkpoint_boundary``: device synchronize at the start and end of each forward and recompute.
* ``profile``: time forwards and recomputes with the ``Timers`` given to :func:`configure`
  (``activation_checkpoint_forward`` / ``activation_checkpoint_recompute``).
"""

from __future__ import annotations

import contextlib
import json
import os
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from .config.errors import ConfigError
from .config.monitoring import ActivationCheckpointingConfig
from .profiling._device import synchronize as _device_synchronize
from .profiling.timers import Timers
from .recompute import MODEL_PARALLEL_RNG, RECOMPUTE_TIMER, Frame, Held, RNGStatesTracker, manual_seed

FORWARD_TIMER = "activation_checkpoint_forward"

__all__ = [
    "ActivationCheckpointing",
    "RNGStatesTracker",
    "checkpoint",
    "checkpointed_bytes",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "reset",
]


# --- configuration -----------------------------------------------------------------------------------


def _mp_size_of(mpu: Any) -> int:
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        getter = getattr(mpu, name, None)
        if callable(getter):
            return int(getter())
    raise ValueError(f"mpu object {type(mpu).__name__} has no get_model_parallel_world_size()")


def _section_from(deepspeed_config: Any) -> ActivationCheckpointingConfig:
    if isinstance(deepspeed_config, str | os.PathLike):
        with open(deepspeed_config, encoding="utf-8") as f:
            deepspeed_config = json.load(f)
    if not isinstance(deepspeed_config, dict):
        raise ValueError(f"deepspeed_config must be a path or a dict, got {type(deepspeed_config).__name__}")
    section = deepspeed_config.get("activation_checkpointing")
    return ActivationCheckpointingConfig.parse_section(section, "activation_checkpointing")


def _configured(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
    *,
    mp_world_size: int | None = None,
) -> tuple[ActivationCheckpointingConfig, int]:
    """The section and model-parallel size :func:`configure`'s arguments describe (validated)."""
    if isinstance(mpu_, ActivationCheckpointingConfig):
        config = mpu_.model_copy()
    elif deepspeed_config is not None:
        config = _section_from(deepspeed_config)
    else:
        config = ActivationCheckpointingConfig()
    if mp_world_size is None:
        mp_world_size = 1 if mpu_ is None or isinstance(mpu_, ActivationCheckpointingConfig) else _mp_size_of(mpu_)
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    for key, value in overrides.items():
        if value is not None:
            setattr(config, key, value)
    _validate(config, mp_world_size)
    return config, mp_world_size


def _validate(config: ActivationCheckpointingConfig, mp_world_size: int) -> None:
    if config.number_checkpoints is not None and config.number_checkpoints < 1:
        raise ConfigError(
            "activation_checkpointing.number_checkpoints", f"must be >= 1, got {config.number_checkpoints}"
        )
    if config.contiguous_memory_optimization and not config.partition_activations:
        raise ConfigError(
            "activation_checkpointing.contiguous_memory_optimization",
            "needs activation_checkpointing.partition_activations set to true (as in DeepSpeed)",
        )
    if config.contiguous_memory_optimization and config.number_checkpoints is None:
        raise ConfigError(
            "activation_checkpointing.number_checkpoints",
            "must be set when contiguous_memory_optimization is true (the number of checkpointed layers)",
        )
    if config.partition_activations and mp_world_size > 1:
        raise NotImplementedError(
            "activation_checkpointing.partition_activations with a model-parallel group of size "
            f"{mp_world_size} is not supported yet (zerospeed has no tensor parallelism); set it to false"
        )


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Copy a held input to host memory (already-host tensors are kept as they are)."""
    return tensor.detach().to("cpu")


class ActivationCheckpointing:
    """One engine's activation checkpointing: its options (the ``activation_checkpointing`` section), its
    model-parallel RNG tracker, the regions awaiting backward and the boundary timers. ``initialize()`` builds
    one per engine (``EngineParts.activation_checkpointing``); inside the engine's calls it is the current
    one (:meth:`active`), so two engines in a process keep their own. DeepSpeed's module-level functions
    below act on the current one, else on the process default (the last engine built with the section)."""

    def __init__(self) -> None:
        self.config = ActivationCheckpointingConfig()
        self.configured = False
        self.mp_world_size = 1
        self.timers: Timers | None = None
        self.tracker = RNGStatesTracker()
        self.live: weakref.WeakSet[Frame] = weakref.WeakSet()
        self._depth = {FORWARD_TIMER: 0, RECOMPUTE_TIMER: 0}

    def configure(self, mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
                  contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
                  checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None, profile: bool | None = None,
                  *, mp_world_size: int | None = None, timers: Timers | None = None) -> ActivationCheckpointingConfig:
        """Set the options used by :meth:`checkpoint` (DeepSpeed's signature, plus our typed section).

        The first argument is either the ``activation_checkpointing`` section (``ActivationCheckpointingConfig``)
        or a DeepSpeed ``mpu`` object (its model-parallel size is read). ``deepspeed_config`` (a path or dict of
        the whole config) supplies the section otherwise; the keyword flags override single fields.
        """
        self.config, self.mp_world_size = _configured(mpu_, deepspeed_config, partition_activations,
                                                      contiguous_checkpointing, num_checkpoints, checkpoint_in_cpu,
                                                      synchronize, profile, mp_world_size=mp_world_size)
        self.timers = timers if timers is not None else (Timers() if self.config.profile else None)
        self.configured = True
        return self.config

    def reset(self) -> None:
        """Forget the configuration and the tracked RNG streams."""
        self.config, self.configured, self.mp_world_size, self.timers = ActivationCheckpointingConfig(), False, 1, None
        self.tracker.reset()

    def model_parallel_cuda_manual_seed(self, seed: int, tp_rank: int = 0) -> None:
        """Seed the default stream with ``seed`` and the model-parallel stream with ``seed + 2718 + tp_rank``."""
        manual_seed(seed)
        self.tracker.reset()
        self.tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make this the current one (DeepSpeed's module-level functions act on it) inside the block."""
        token = _CURRENT.set(self)
        try:
            yield
        finally:
            _CURRENT.reset(token)

    @contextlib.contextmanager
    def boundary(self, timer_name: str) -> Iterator[None]:
        """Synchronize and/or time the outermost forward or recompute, as configured."""
        config, timers = self.config, self.timers
        outer = self._depth[timer_name] == 0
        self._depth[timer_name] += 1
        if config.synchronize_checkpoint_boundary:
            _device_synchronize()
        if config.profile and timers is not None and outer:
            timers(timer_name).start()
        try:
            yield
        finally:
            self._depth[timer_name] -= 1
            if config.synchronize_checkpoint_boundary:
                _device_synchronize()
            if config.profile and timers is not None and outer:
                timers(timer_name).stop()

    def hold(self, tensor: torch.Tensor) -> Held:
        """One region input as kept until its recompute: on the host (``cpu_checkpointing``), contiguous."""
        kept = _to_host(tensor) if self.config.cpu_checkpointing else tensor.detach()
        if self.config.contiguous_memory_optimization:
            kept = kept.contiguous()
        return Held(kept, tensor.device, tensor.requires_grad)

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """See the module-level :func:`checkpoint`."""
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)
        self._check_capacity()
        frame = Frame(self, function, args, kwargs)
        self.live.add(frame)
        with self.boundary(FORWARD_TIMER), torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
            return function(*args, **kwargs)

    def _check_capacity(self) -> None:
        """``contiguous_memory_optimization`` holds the inputs of at most ``number_checkpoints`` regions at once
        (DeepSpeed sizes its contiguous buffers by it and fails beyond); say so instead of growing silently."""
        limit = self.config.number_checkpoints
        if self.config.contiguous_memory_optimization and limit is not None and len(self.live) >= limit:
            raise ConfigError("activation_checkpointing.number_checkpoints",
                              f"this forward checkpoints more than {limit} regions before their backward, but "
                              "contiguous_memory_optimization holds at most number_checkpoints regions' inputs; set "
                              "it to the number of checkpointed layers")

    def checkpointed_bytes(self) -> int:
        """Bytes of region inputs held by checkpoints whose backward has not released them yet."""
        seen: set[tuple[str, int]] = set()
        total = 0
        for frame in list(self.live):
            for tensor in frame.held_tensors():
                storage = tensor.untyped_storage()
                key = (str(tensor.device), storage.data_ptr())
                if key not in seen:
                    seen.add(key)
                    total += storage.nbytes()
        return total


class _ProcessDefault:
    """The one DeepSpeed's module-level API acts on outside any engine call."""

    def __init__(self) -> None:
        self.instance = ActivationCheckpointing()


_PROCESS = _ProcessDefault()
_CURRENT: ContextVar[ActivationCheckpointing | None] = ContextVar("zerospeed_activation_checkpointing", default=None)


def current() -> ActivationCheckpointing:
    """The running engine's activation checkpointing, else the process default."""
    return _CURRENT.get() or _PROCESS.instance


def set_default(ac: ActivationCheckpointing) -> None:
    """Make ``ac`` the process default (``initialize()`` with an ``activation_checkpointing`` section, as
    DeepSpeed's initialize configures ``deepspeed.checkpointing``)."""
    _PROCESS.instance = ac


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None, profile: bool | None = None,
              *, mp_world_size: int | None = None, timers: Timers | None = None) -> ActivationCheckpointingConfig:
    """DeepSpeed's ``deepspeed.checkpointing.configure``, on the current one (see :meth:`ActivationCheckpointing.configure`)."""
    return current().configure(mpu_, deepspeed_config, partition_activations, contiguous_checkpointing,
                               num_checkpoints, checkpoint_in_cpu, synchronize, profile, mp_world_size=mp_world_size,
                               timers=timers)


def is_configured() -> bool:
    """True once :func:`configure` has been called (on the current one)."""
    return current().configured


def reset() -> None:
    """Forget the current one's configuration and tracked RNG streams (tests, or a new engine)."""
    current().reset()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    return current().tracker


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int = 0) -> None:
    """Seed the default stream with ``seed`` and the model-parallel stream with ``seed + 2718 + tp_rank``."""
    current().model_parallel_cuda_manual_seed(seed, tp_rank)


@torch._disable_dynamo
def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` keeping only its inputs; recompute its activations in backward.

    Works without :func:`configure` (default options). Outputs are whatever ``function`` returns. Under
    ``torch.no_grad()`` the function simply runs. Inside a compiled model (``engine.compile()``) the region
    runs eagerly, a graph break: its recompute hands saved tensors back by position, which only the same
    eager operations reproduce (a traced region saves others). Acts on the current activation checkpointing.
    """
    return current().checkpoint(function, *args, **kwargs)


non_reentrant_checkpoint = checkpoint


def checkpointed_bytes() -> int:
    """Bytes of region inputs held by the current one's checkpoints whose backward has not released them yet."""
    return current().checkpointed_bytes()
