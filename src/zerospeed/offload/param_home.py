"""ZeRO-Infinity parameter offload: where each rank's stage-3 parameter shards live between uses.

``cpu``: the shard is a host tensor (pinned when asked, on CUDA); loading it copies it to the device (on
a CPU-only machine the host tensor *is* the device tensor: nothing moves). ``nvme``: the shard is one
swap file of the :class:`AsyncSwapper` (O_DIRECT where allowed, every read length-checked); the first
``max_in_cpu`` elements adopted stay on the host instead. A load waits for a read started earlier by
:meth:`ParamHome.prefetch` (the fetcher reads ahead in the recorded module order) or reads now; the
4 KiB-aligned read buffer becomes the shard until the gather that needed it has finished.

Failures: a read that fails raises :class:`OffloadIOError` naming the file and leaves the shard
non-resident (nothing reaches the weights; the file still holds the last good value). A write that
fails marks the shard broken: later loads raise naming the file instead of reading a half-written one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config.offload import AioConfig, OffloadParamConfig
from ..zero.stage3.param_store import ParamShard
from .preflight import check_nvme_path
from .swapper import AsyncSwapper, Handle, OffloadIOError, aligned_empty
from ..accelerator import can_pin_memory

KEY = "zero_optimization.offload_param"


class ParamHome:
    """The home of every offloaded shard of one rank (see the module docstring)."""

    def __init__(self, cfg: OffloadParamConfig, aio: AioConfig, rank: int, need_bytes: int = 0) -> None:
        self.cfg = cfg
        self.read_ahead_numel = cfg.buffer_count * cfg.buffer_size
        self.host: dict[str, torch.Tensor] = {}
        self.host_numel = 0
        self.pending: dict[str, tuple[torch.Tensor, Handle]] = {}
        self.broken: dict[str, str] = {}
        self.count = 0
        self.swapper: AsyncSwapper | None = None
        if cfg.device == "nvme":
            root = check_nvme_path(cfg.nvme_path, need_bytes, f"{KEY}.nvme_path")
            self.swapper = AsyncSwapper(root, aio.block_size, aio.intra_op_parallelism,
                                        prefix=f"zerospeed_param_rank{rank}_", queue_depth=aio.queue_depth)

    # --- ShardHome ---------------------------------------------------------------------------------
    @torch.no_grad()
    def adopt(self, shard: ParamShard) -> None:
        """Take the shard's current value in; ``local`` becomes a placeholder."""
        if shard.home is not None or shard.local is None:
            raise RuntimeError("only a partitioned, not yet offloaded parameter can be offloaded")
        shard.home, shard.home_key = self, f"p{self.count}"
        self.count += 1
        self.store(shard, shard.local)

    def _on_host(self, shard: ParamShard) -> bool:
        return self.swapper is None or shard.home_key in self.host

    @torch.no_grad()
    def store(self, shard: ParamShard, values: torch.Tensor) -> None:
        """Write a new value of the shard (flat, ``shard.shard`` elements) and drop the resident copy."""
        key, values = shard.home_key, values.detach().reshape(-1)
        if values.numel() != shard.shard:
            raise ValueError(f"shard {key}: {values.numel()} elements given, {shard.shard} expected")
        self._drop_pending(key)  # a read started before would bring the old value
        fits = self.host_numel + values.numel() <= self.cfg.max_in_cpu
        if self.swapper is None or key in self.host or (fits and key not in self.swapper.sizes):
            old = self.host.get(key)
            if old is None or old.dtype != values.dtype or old.numel() != values.numel():
                pin = self.cfg.pin_memory and can_pin_memory()
                self.host_numel += values.numel() - (0 if old is None else old.numel())
                self.host[key] = torch.empty(values.numel(), dtype=values.dtype, pin_memory=pin)
            self.host[key].copy_(values)
        else:
            buf = aligned_empty(values.nbytes, pin=self.cfg.pin_memory)
            buf[: values.nbytes].view(values.dtype).copy_(values)
            try:
                self.swapper.write(key, buf[: values.nbytes]).wait()
            except OffloadIOError as exc:
                self.broken[key] = str(exc)
                raise
            self.broken.pop(key, None)
        self.evict(shard)

    def prefetch(self, shards: Sequence[ParamShard]) -> None:
        for s in shards:
            key = s.home_key
            if s.resident or self._on_host(s) or key in self.pending or key in self.broken:
                continue
            assert self.swapper is not None
            nbytes = s.shard * s.dtype.itemsize
            buf = aligned_empty(nbytes, pin=self.cfg.pin_memory)
            self.pending[key] = (buf, self.swapper.read(key, buf[:nbytes]))

    @torch.no_grad()
    def load(self, shards: Sequence[ParamShard]) -> None:
        """Make every shard resident; raises ``OffloadIOError`` naming the file when a read fails."""
        todo = [s for s in shards if not s.resident]
        for s in todo:
            if s.home_key in self.broken:
                raise OffloadIOError(self.swapper.path(s.home_key) if self.swapper else s.home_key, "read",
                                     "an earlier write of this shard failed; its content is not trustworthy: "
                                     f"{self.broken[s.home_key]}")
        self.prefetch(todo)
        for s in todo:
            if self._on_host(s):
                s.local = self.host[s.home_key].to(s.device, non_blocking=True)
            else:
                buf, handle = self.pending.pop(s.home_key)
                try:
                    handle.wait()  # raises naming the file; the shard stays non-resident
                except OffloadIOError:
                    for key in list(self.pending):  # reads started alongside may have failed too: start over
                        self._drop_pending(key)
                    raise
                s.local = buf[: s.shard * s.dtype.itemsize].view(s.dtype).to(s.device)
            s.resident = True

    def evict(self, shard: ParamShard) -> None:
        shard.local = torch.empty(0, dtype=shard.dtype, device=shard.device)
        shard.resident = False

    # --- bookkeeping -------------------------------------------------------------------------------
    def _drop_pending(self, key: str) -> None:
        item = self.pending.pop(key, None)
        if item is not None:
            try:
                item[1].wait()
            except OffloadIOError:
                pass

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())

    def disk_bytes(self) -> int:
        return 0 if self.swapper is None else self.swapper.disk_bytes()

    def close(self) -> None:
        """Finish reads in flight and remove the swap files."""
        for key in list(self.pending):
            self._drop_pending(key)
        if self.swapper is not None:
            self.swapper.close()


def shard_bytes(shards: Sequence[ParamShard], dtype: torch.dtype) -> int:
    """Bytes the swap files of ``shards`` need in ``dtype`` (each padded to 4 KiB)."""
    return sum((s.shard * dtype.itemsize + 4095) // 4096 * 4096 for s in shards)


__all__ = ["ParamHome", "shard_bytes"]
