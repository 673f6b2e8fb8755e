"""CUDA: nccl, device memory from the caching allocator, pinned host buffers."""

from __future__ import annotations

from typing import Any

import torch

from .base import Accelerator


class CudaAccelerator(Accelerator):
    name = "cuda"
    communication_backend = "nccl"

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0

    def device(self, local_rank: int | None = None) -> torch.device:
        if local_rank is None:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cuda", local_rank % torch.cuda.device_count())

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_allocated(self) -> int:
        return int(torch.cuda.memory_allocated())

    def max_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated())

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def get_rng_state(self) -> torch.Tensor | None:
        return torch.cuda.get_rng_state()

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if state is not None:
            torch.cuda.set_rng_state(state)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def current_device(self) -> int:
        return int(torch.cuda.current_device())

    def device_count(self) -> int:
        return int(torch.cuda.device_count())

    def is_available(self) -> bool:
        return self.available()

    def is_synchronized_device(self) -> bool:
        return False

    def is_fp16_supported(self) -> bool:
        return True

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def total_memory(self) -> int:
        return int(torch.cuda.get_device_properties(self.current_device()).total_memory)

    def available_memory(self) -> int:
        free, _ = torch.cuda.mem_get_info()
        return int(free)

    def memory_reserved(self) -> int:
        return int(torch.cuda.memory_reserved())

    def max_memory_reserved(self) -> int:
        return int(torch.cuda.max_memory_reserved())

    def pin_memory(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()

    def side_stream(self) -> Any:
        return torch.cuda.Stream()

    def copy_to_host(self, src: torch.Tensor, pin: bool, stream: Any) -> tuple[torch.Tensor, Any]:
        """Device-to-host on ``stream`` after the work already queued on the current stream; ``src``'s memory
        is not reused by the caching allocator until the copy is done (``record_stream``)."""
        if src.device.type != "cuda":
            return src.to("cpu", copy=True), torch.cuda.Event()  # an unrecorded event: synchronize() returns
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            host.copy_(src, non_blocking=pin)
            src.record_stream(stream)
            done = torch.cuda.Event()
            done.record(stream)
        return host, done
