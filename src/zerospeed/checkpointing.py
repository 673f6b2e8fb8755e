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
from dataclasses import dataclass, field
from typing import Any

import torch

from .config.errors import ConfigError
from .config.monitoring import ActivationCheckpointingConfig
from .profiling._device import cuda_active
from .profiling._device import synchronize as _device_synchronize
from .profiling.timers import Timers

FORWARD_TIMER = "activation_checkpoint_forward"
RECOMPUTE_TIMER = "activation_checkpoint_recompute"
MODEL_PARALLEL_RNG = "model-parallel-rng"

__all__ = [
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


# --- model-parallel RNG tracker ----------------------------------------------------------------------
class RNGStatesTracker:
    """Named RNG streams (DeepSpeed's ``CudaRNGStatesTracker``), on the current CUDA device or the CPU.

    ``with tracker.fork():`` draws from the named stream instead of the default one, e.g. so dropout in
    tensor-parallel regions differs across model-parallel ranks while the rest stays identical.
    """

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        self.states.clear()
        self.seeds.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states:
            raise ValueError(f"RNG state '{name}' is already tracked")
        self.seeds.add(seed)
        with _fork_default_rng():
            _manual_seed(seed)
            self.states[name] = _get_rng_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states:
            raise ValueError(f"RNG state '{name}' is not tracked; known: {sorted(self.states)}")
        original = _get_rng_state()
        _set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_rng_state()
            _set_rng_state(original)


def _get_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if cuda_active() else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    if cuda_active():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if cuda_active():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


@contextlib.contextmanager
def _fork_default_rng() -> Iterator[None]:
    state = _get_rng_state()
    try:
        yield
    finally:
        _set_rng_state(state)


_RNG_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    return _RNG_TRACKER


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int = 0) -> None:
    """Seed the default stream with ``seed`` and the model-parallel stream with ``seed + 2718 + tp_rank``."""
    _manual_seed(seed)
    _RNG_TRACKER.reset()
    _RNG_TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)


# --- configuration -----------------------------------------------------------------------------------
@dataclass
class _Settings:
    config: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    configured: bool = False
    mp_world_size: int = 1
    timers: Timers | None = None


_SETTINGS = _Settings()


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


def configure(
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
    timers: Timers | None = None,
) -> ActivationCheckpointingConfig:
    """Set the options used by :func:`checkpoint` (DeepSpeed's signature, plus our typed section).

    The first argument is either the ``activation_checkpointing`` section (``ActivationCheckpointingConfig``)
    or a DeepSpeed ``mpu`` object (its model-parallel size is read). ``deepspeed_config`` (a path or dict of
    the whole config) supplies the section otherwise; the keyword flags override single fields.
    """
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
    _SETTINGS.config = config
    _SETTINGS.mp_world_size = mp_world_size
    _SETTINGS.timers = timers if timers is not None else (Timers() if config.profile else None)
    _SETTINGS.configured = True
    return config


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


def is_configured() -> bool:
    """True once :func:`configure` has been called."""
    return _SETTINGS.configured


def reset() -> None:
    """Forget the configuration and the tracked RNG streams (tests, or a new engine)."""
    global _SETTINGS
    _SETTINGS = _Settings()
    _RNG_TRACKER.reset()


# --- the checkpoint itself ---------------------------------------------------------------------------
def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Copy a held input to host memory (already-host tensors are kept as they are)."""
    return tensor.detach().to("cpu")


@dataclass
class _Held:
    """One region input: the tensor kept (possibly on the host), where it lives, and if it needs grad."""

    tensor: torch.Tensor
    device: torch.device
    requires_grad: bool

    def restore(self) -> torch.Tensor:
        tensor = self.tensor.to(self.device, non_blocking=True).detach()
        return tensor.requires_grad_(self.requires_grad)


@dataclass
class _RngSnapshot:
    cpu: torch.Tensor
    cuda: dict[int, torch.Tensor]
    tracker: dict[str, torch.Tensor]

    @classmethod
    def capture(cls, devices: set[int]) -> _RngSnapshot:
        cuda = {d: torch.cuda.get_rng_state(d) for d in devices}
        return cls(torch.get_rng_state(), cuda, _RNG_TRACKER.get_states())

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        current = _RngSnapshot.capture(set(self.cuda))
        self._apply()
        try:
            yield
        finally:
            current._apply()

    def _apply(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in self.cuda.items():
            torch.cuda.set_rng_state(state, device)
        _RNG_TRACKER.set_states(self.tracker)


def _autocast_states() -> list[tuple[str, bool, torch.dtype]]:
    types = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types]


_LIVE_FRAMES: weakref.WeakSet[_Frame] = weakref.WeakSet()
_depth = {FORWARD_TIMER: 0, RECOMPUTE_TIMER: 0}


@contextlib.contextmanager
def _boundary(timer_name: str) -> Iterator[None]:
    """Synchronize and/or time the outermost forward or recompute, as configured."""
    config, timers = _SETTINGS.config, _SETTINGS.timers
    outer = _depth[timer_name] == 0
    _depth[timer_name] += 1
    if config.synchronize_checkpoint_boundary:
        _device_synchronize()
    if config.profile and timers is not None and outer:
        timers(timer_name).start()
    try:
        yield
    finally:
        _depth[timer_name] -= 1
        if config.synchronize_checkpoint_boundary:
            _device_synchronize()
        if config.profile and timers is not None and outer:
            timers(timer_name).stop()


class _Frame:
    """One checkpointed call: its held inputs and states, and the recomputed tensors handed to backward."""

    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        config = _SETTINGS.config
        self.function = function
        self.kwargs = kwargs
        self.inputs: list[Any] = [self._hold(a, config) if isinstance(a, torch.Tensor) else a for a in args]
        devices = {a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda}
        if cuda_active():
            devices.add(torch.cuda.current_device())
        self.rng = _RngSnapshot.capture(devices)
        self.autocast = _autocast_states()
        self.packed = 0
        self.saved: list[torch.Tensor | None] = []

    @staticmethod
    def _hold(tensor: torch.Tensor, config: ActivationCheckpointingConfig) -> _Held:
        kept = _to_host(tensor) if config.cpu_checkpointing else tensor.detach()
        if config.contiguous_memory_optimization:
            kept = kept.contiguous()
        return _Held(kept, tensor.device, tensor.requires_grad)

    def held_tensors(self) -> list[torch.Tensor]:
        return [h.tensor for h in self.inputs if isinstance(h, _Held)]

    def pack(self, tensor: torch.Tensor) -> int:
        index = self.packed
        self.packed += 1
        return index

    def unpack(self, index: int) -> torch.Tensor:
        if index >= len(self.saved) or self.saved[index] is None:
            self.recompute()  # first use, or a second backward through a retained graph
        tensor = self.saved[index]
        self.saved[index] = None  # free as soon as backward has taken it
        assert tensor is not None
        return tensor

    def recompute(self) -> None:
        inputs = [h.restore() if isinstance(h, _Held) else h for h in self.inputs]
        saved: list[torch.Tensor | None] = []

        def keep(tensor: torch.Tensor) -> None:
            saved.append(tensor.detach())

        with contextlib.ExitStack() as stack:
            stack.enter_context(_boundary(RECOMPUTE_TIMER))
            stack.enter_context(self.rng.restored())
            for device_type, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(keep, _never_unpacked))
            self.function(*inputs, **self.kwargs)
        if len(saved) != self.packed:
            raise RuntimeError(
                f"activation checkpoint recompute saved {len(saved)} tensors but the forward saved "
                f"{self.packed}: the checkpointed function must run the same operations both times"
            )
        self.saved = saved


def _never_unpacked(_: Any) -> torch.Tensor:
    raise RuntimeError("internal error: a recomputed activation graph was used for backward")


@torch._disable_dynamo
def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` keeping only its inputs; recompute its activations in backward.

    Works without :func:`configure` (default options). Outputs are whatever ``function`` returns. Under
    ``torch.no_grad()`` the function simply runs. Inside a compiled model (``engine.compile()``) the region
    runs eagerly, a graph break: its recompute hands saved tensors back by position, which only the same
    eager operations reproduce (a traced region saves others).
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    _check_capacity(_SETTINGS.config)
    frame = _Frame(function, args, kwargs)
    _LIVE_FRAMES.add(frame)
    with _boundary(FORWARD_TIMER), torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return function(*args, **kwargs)


non_reentrant_checkpoint = checkpoint


def _check_capacity(config: ActivationCheckpointingConfig) -> None:
    """``contiguous_memory_optimization`` holds the inputs of at most ``number_checkpoints`` regions at once
    (DeepSpeed sizes its contiguous buffers by it and fails beyond); say so instead of growing silently."""
    limit = config.number_checkpoints
    if config.contiguous_memory_optimization and limit is not None and len(_LIVE_FRAMES) >= limit:
        raise ConfigError("activation_checkpointing.number_checkpoints",
                          f"this forward checkpoints more than {limit} regions before their backward, but "
                          "contiguous_memory_optimization holds at most number_checkpoints regions' inputs; set it "
                          "to the number of checkpointed layers")


def checkpointed_bytes() -> int:
    """Bytes of region inputs held by checkpoints whose backward has not released them yet."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for frame in list(_LIVE_FRAMES):
        for tensor in frame.held_tensors():
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total
