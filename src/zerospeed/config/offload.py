"""``zero_optimization.offload_optimizer``, ``zero_optimization.offload_param`` and ``aio`` (DeepSpeed names
and defaults).

ZeRO-Offload keeps the fp32 optimizer step (and its state) on the host: ``device: cpu`` holds the state in
host memory, ``device: nvme`` streams it to and from files under ``nvme_path`` in sub-groups of
``zero_optimization.sub_group_size`` elements. ZeRO-Infinity's ``offload_param`` (stage 3) keeps the
parameter shards there too. ``aio`` tunes the file I/O.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import Section

OffloadDevice = Literal["none", "cpu", "nvme"]


def _device_alias(v: Any) -> Any:
    return "none" if v is None else (str(v).lower() if isinstance(v, str) else v)


class OffloadOptimizerConfig(Section):
    """Where the fp32 optimizer step runs and its state lives: ``none`` (the accelerator), ``cpu``, ``nvme``.

    ``buffer_count`` host buffers stream the ``nvme`` state (``buffer_count - 2`` sub-groups read ahead, one
    written behind; at least 3); ``pin_memory`` pins them and the host gradient partitions (CUDA only);
    ``ratio`` (DeepSpeed's partial offload, Offload++) is the fraction of the optimizer's sub-groups stepped on
    the host: the first ``int((1 - ratio) * n)`` of the ``n`` sub-groups keep their master and state on the
    device and step there, in parallel with the host step of the rest (``offload/partial.py``); ``device: cpu``
    only. ``fast_init`` and ``pipeline_read`` /
    ``pipeline_write`` are performance hints whose effect zerospeed always has: the master is written
    straight into the swap files and the zero state only reserved (fallocate), and sub-group reads and
    writes always overlap the step (DeepSpeed's ``false`` only turns that overlap off).
    """

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    buffer_count: int = Field(4, ge=1)
    pin_memory: bool = True  # DeepSpeed's default; pinning happens only on an accelerator (CUDA)
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    super_offload: bool = False
    """SuperOffload (``offload/super_offload.py``): each sub-group's host step starts during backward, as soon
    as its gradient is complete, and is validated (kept, or rolled back on overflow) at ``step()``. ZeRO
    stage 3, ``device: cpu``, ``ratio: 1``; speculates only with ``gradient_clipping: 0`` (as DeepSpeed)."""
    cpuadam_cores_perc: float = Field(0.8, gt=0.0, le=1.0)
    """The share of the host's cores the host optimizer step computes with (offload/cores.py)."""

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, v: Any) -> Any:
        return _device_alias(v)

    @model_validator(mode="after")
    def _check(self) -> OffloadOptimizerConfig:
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("device 'nvme' needs nvme_path: a directory on a fast local disk")
        if self.device == "nvme" and self.buffer_count < 3:
            raise ValueError(f"device 'nvme' needs buffer_count >= 3 (read-ahead, update, write-behind), got "
                             f"{self.buffer_count}")
        if self.super_offload and (self.device != "cpu" or self.ratio != 1.0):
            raise ValueError(f"super_offload steps on the host: it needs device 'cpu' (got {self.device!r}) and "
                             f"ratio 1.0 (got {self.ratio}; partial offload with super_offload is not supported yet "
                             "by zerospeed)")
        if self.device == "nvme" and self.ratio != 1.0:
            raise ValueError(f"ratio {self.ratio} (partial offload) with device 'nvme' is not supported yet by "
                             "zerospeed; use device 'cpu' or ratio 1.0")
        return self

    @property
    def enabled(self) -> bool:
        return self.device != "none"


class OffloadParamConfig(Section):
    """ZeRO-Infinity parameter offload (stage 3): where each rank's parameter shards live between uses.

    ``cpu``: host memory; ``nvme``: one swap file per shard under ``nvme_path`` (except the first
    ``max_in_cpu`` elements, kept on the host). Shards are read back before a module's all-gather, read
    ahead in the recorded module order up to ``buffer_count * buffer_size`` elements, and dropped after
    the gather; ``pin_memory`` pins the host copies (CUDA only).
    """

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    buffer_count: int = Field(5, ge=1)
    buffer_size: int = Field(100_000_000, gt=0)
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    pin_memory: bool = True  # DeepSpeed's default; pinning happens only on an accelerator (CUDA)

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, v: Any) -> Any:
        return _device_alias(v)

    @model_validator(mode="after")
    def _check(self) -> OffloadParamConfig:
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("device 'nvme' needs nvme_path: a directory on a fast local disk")
        return self

    @property
    def enabled(self) -> bool:
        return self.device != "none"


class AioConfig(Section):
    """Asynchronous file I/O for NVMe offload.

    ``block_size`` bytes per request; ``intra_op_parallelism`` (DeepSpeed's older ``thread_count``) threads
    move the requests; ``queue_depth`` caps the requests in flight per swapper (the rest wait in a FIFO).
    ``single_submit`` and ``overlap_events`` are libaio submission hints whose effect zerospeed's thread-pool
    I/O always has (each request issued on its own as soon as a slot frees up); ``use_gds`` (GPUDirect
    Storage) is not supported.
    """

    block_size: int = Field(1_048_576, gt=0)
    queue_depth: int = Field(8, ge=1)
    intra_op_parallelism: int = Field(1, ge=1)
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False

    @model_validator(mode="before")
    @classmethod
    def _thread_count_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and "thread_count" in data:
            data = dict(data)
            value = data.pop("thread_count")
            data.setdefault("intra_op_parallelism", value)
        return data

    @field_validator("block_size")
    @classmethod
    def _aligned(cls, v: int) -> int:
        if v % 4096:
            raise ValueError(f"block_size must be a multiple of 4096 bytes (direct I/O alignment), got {v}")
        return v

    @field_validator("use_gds")
    @classmethod
    def _no_gds(cls, v: bool) -> bool:
        if v:
            raise ValueError("use_gds (GPUDirect Storage) is not supported by zerospeed: it needs CUDA with the "
                             "cuFile library; set it to false (I/O goes through pinned host buffers)")
        return v
