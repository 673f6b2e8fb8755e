"""What the rest of zerospeed may ask of a device."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class Accelerator(ABC):
    name: str
    communication_backend: str

    @abstractmethod
    def device(self, local_rank: int | None = None) -> torch.device: ...

    @abstractmethod
    def set_device(self, local_rank: int) -> None: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def memory_allocated(self) -> int: ...

    @abstractmethod
    def max_memory_allocated(self) -> int: ...

    @abstractmethod
    def reset_peak_memory_stats(self) -> None: ...

    @abstractmethod
    def get_rng_state(self) -> torch.Tensor | None: ...

    @abstractmethod
    def set_rng_state(self, state: torch.Tensor | None) -> None: ...

    @abstractmethod
    def is_bf16_supported(self) -> bool: ...

    def pin_memory(self, t: torch.Tensor) -> torch.Tensor:
        return t

    # --- DeepSpeed's accelerator surface that training scripts call ------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` / ``"cpu"``, or ``"cuda:1"`` with an index (DeepSpeed's ``device_name``)."""
        return self.name if device_index is None else f"{self.name}:{device_index}"

    def current_device(self) -> int:
        return 0

    def current_device_name(self) -> str:
        return str(self.device())

    def device_count(self) -> int:
        return 1

    def is_available(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        """True where work runs synchronously with the host (CPU), as DeepSpeed's."""
        return True

    def communication_backend_name(self) -> str:
        return self.communication_backend

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float32]
        if self.is_fp16_supported():
            out.append(torch.float16)
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        return out

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def empty_cache(self) -> None:
        return None

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.name

    def total_memory(self) -> int:
        import psutil

        return int(psutil.virtual_memory().total)

    def available_memory(self) -> int:
        import psutil

        return int(psutil.virtual_memory().available)

    def max_memory_reserved(self) -> int:
        return self.max_memory_allocated()

    def memory_reserved(self) -> int:
        return self.memory_allocated()

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    compile_backend: str = "inductor"

    def get_compile_backend(self) -> str:
        """The ``torch.compile`` backend ``engine.compile()`` uses by default (DeepSpeed's: inductor)."""
        return self.compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Choose that default among the backends torch registers (``torch._dynamo.list_backends``)."""
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"{backend} not supported by {self.device_name()}. Supported backends are {known}")
        self.compile_backend = backend

    # --- copies to the host off the compute stream (offload) ----------------------------------------
    def side_stream(self) -> Any:
        """A stream for copies that overlap compute, or None where copies are synchronous (CPU)."""
        return None

    def copy_to_host(self, src: torch.Tensor, pin: bool, stream: Any) -> tuple[torch.Tensor, Any]:
        """Start copying device tensor ``src`` into a new host tensor (pinned if asked and possible) on
        ``stream``; returns ``(host, done)``: ``done.synchronize()`` waits for the copy. CPU: a plain copy."""
        return src.to("cpu", copy=True), _Ready()


class _Ready:
    def synchronize(self) -> None:
        return None
