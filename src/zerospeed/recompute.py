"""The recompute machinery behind activation checkpointing (``checkpointing.py``): one checkpointed call's
held inputs, RNG and autocast states, and the saved-tensor hooks that hand recomputed tensors to backward;
the model-parallel RNG tracker (DeepSpeed's ``CudaRNGStatesTracker``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .profiling._device import cuda_active

MODEL_PARALLEL_RNG = "model-parallel-rng"
RECOMPUTE_TIMER = "activation_checkpoint_recompute"


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
            manual_seed(seed)
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


def manual_seed(seed: int) -> None:
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


# --- the checkpoint itself ---------------------------------------------------------------------------
@dataclass
class Held:
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
    owner: RNGStatesTracker

    @classmethod
    def capture(cls, devices: set[int], owner: RNGStatesTracker) -> _RngSnapshot:
        cuda = {d: torch.cuda.get_rng_state(d) for d in devices}
        return cls(torch.get_rng_state(), cuda, owner.get_states(), owner)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        current = _RngSnapshot.capture(set(self.cuda), self.owner)
        self._apply()
        try:
            yield
        finally:
            current._apply()

    def _apply(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in self.cuda.items():
            torch.cuda.set_rng_state(state, device)
        self.owner.set_states(self.tracker)


def _autocast_states() -> list[tuple[str, bool, torch.dtype]]:
    types = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types]


class Frame:
    """One checkpointed call: its held inputs and states, and the recomputed tensors handed to backward."""

    def __init__(self, owner: Any, function: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        config = owner.config
        self.owner = owner
        self.function = function
        self.kwargs = kwargs
        self.inputs: list[Any] = [owner.hold(a) if isinstance(a, torch.Tensor) else a for a in args]
        devices = {a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda}
        if cuda_active():
            devices.add(torch.cuda.current_device())
        self.rng = _RngSnapshot.capture(devices, owner.tracker)
        self.autocast = _autocast_states()
        self.packed = 0
        self.saved: list[torch.Tensor | None] = []

    def held_tensors(self) -> list[torch.Tensor]:
        return [h.tensor for h in self.inputs if isinstance(h, Held)]

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
        inputs = [h.restore() if isinstance(h, Held) else h for h in self.inputs]
        saved: list[torch.Tensor | None] = []

        def keep(tensor: torch.Tensor) -> None:
            saved.append(tensor.detach())

        with contextlib.ExitStack() as stack:
            stack.enter_context(self.owner.boundary(RECOMPUTE_TIMER))
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

