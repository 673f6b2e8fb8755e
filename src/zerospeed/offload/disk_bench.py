"""Disk bandwidth for NVMe offload: the raw sequential rate (one thread, large O_DIRECT requests, like
``dd oflag=direct``) against the swapper's rate for several ``aio`` settings, and the best of these.

Everything is written under a private directory that is removed afterwards. Buffered (page-cache) I/O
would measure memory, not the disk, so a file system without O_DIRECT is reported as such.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass


from .swapper import ALIGN, AsyncSwapper, aligned_empty

MiB = 1 << 20


@dataclass
class Rate:
    label: str
    block_size: int
    threads: int
    write_mb_s: float
    read_mb_s: float


def raw_sequential(directory: str, total: int, block: int = 8 * MiB) -> Rate:
    """One thread, ``block``-byte O_DIRECT requests (buffered if the file system refuses O_DIRECT), fsync."""
    root = tempfile.mkdtemp(prefix="zerospeed_raw_", dir=directory)
    path = os.path.join(root, "raw.bin")
    buf = aligned_empty(block)
    buf.random_(0, 255)
    view = memoryview(buf.numpy())
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        except OSError:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            t0 = time.perf_counter()
            for off in range(0, total, block):
                os.pwritev(fd, [view], off)
            os.fsync(fd)
            t1 = time.perf_counter()
            for off in range(0, total, block):
                os.preadv(fd, [view], off)
            t2 = time.perf_counter()
        finally:
            os.close(fd)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return Rate("raw sequential (dd-like)", block, 1, total / MiB / (t1 - t0), total / MiB / (t2 - t1))


def swapper_rate(directory: str, total: int, block_size: int, threads: int, buffer_bytes: int = 64 * MiB,
                 queue_depth: int = 8) -> Rate:
    """The swapper moving ``total`` bytes as ``buffer_bytes`` buffers (as sub-groups are), writes then reads."""
    sw = AsyncSwapper(directory, block_size=block_size, threads=threads, queue_depth=queue_depth)
    count = max(1, total // buffer_bytes)
    bufs = [aligned_empty(buffer_bytes) for _ in range(min(count, 4))]
    for b in bufs:
        b.random_(0, 255)
    try:
        t0 = time.perf_counter()
        pending = [sw.write(f"b{i}", bufs[i % len(bufs)]) for i in range(count)]
        for h in pending:
            h.wait()
        fd = os.open(sw.root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        t1 = time.perf_counter()
        pending = [sw.read(f"b{i}", bufs[i % len(bufs)]) for i in range(count)]
        for h in pending:
            h.wait()
        t2 = time.perf_counter()
        moved = count * buffer_bytes
        return Rate("swapper" + ("" if sw.direct else " (buffered: no O_DIRECT)"), block_size, threads,
                    moved / MiB / (t1 - t0), moved / MiB / (t2 - t1))
    finally:
        sw.close()


def sweep(directory: str, total: int, blocks: list[int], threads: list[int]) -> tuple[Rate, list[Rate]]:
    """The raw rate and the swapper's rate for every (block_size, threads)."""
    raw = raw_sequential(directory, total)
    rates = [swapper_rate(directory, total, b, t) for b in blocks for t in threads]
    return raw, rates


def suggest(rates: list[Rate]) -> dict[str, object]:
    """The ``aio`` section of the fastest setting (read and write weighted equally)."""
    best = max(rates, key=lambda r: min(r.read_mb_s, r.write_mb_s) + r.read_mb_s + r.write_mb_s)
    return {"aio": {"block_size": best.block_size, "intra_op_parallelism": best.threads, "queue_depth": 8,
                    "single_submit": False, "overlap_events": True}}


def check_space(directory: str, total: int) -> None:
    if shutil.disk_usage(directory).free < 2 * total + 64 * MiB:
        raise ValueError(f"{directory!r} has too little free space for a {total / MiB:.0f} MiB test")
    if total % ALIGN:
        raise ValueError("the test size must be a multiple of 4096 bytes")


__all__ = ["Rate", "check_space", "raw_sequential", "suggest", "swapper_rate", "sweep"]
