"""Asynchronous tensor swapper: whole host buffers to and from files, on a thread pool.

Each transfer is cut into ``block_size`` pieces that the pool's ``threads`` workers move with
``os.pwritev`` / ``os.preadv`` (which release the GIL), so a read of the next buffer and a write of the
previous one proceed while the caller computes. Files are opened with ``O_DIRECT`` when the file system
allows it and the buffer is 4 KiB-aligned with a 4 KiB-padded length (see :func:`aligned_empty`); otherwise
through the page cache. Every transfer is length-checked: a short, failed or never-written read raises
:class:`OffloadIOError` naming the file, and the caller's buffer must then be considered garbage.
Files live in a private directory that :meth:`AsyncSwapper.close` (also run at exit) removes.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

ALIGN = 4096


class OffloadIOError(RuntimeError):
    """A swap file could not be read or written; the message names the file and the operation."""

    def __init__(self, path: str, op: str, detail: str) -> None:
        self.path, self.op = path, op
        super().__init__(f"offload {op} of {path!r} failed: {detail}")


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 host buffer of ``round_up(nbytes)`` bytes whose address is 4 KiB-aligned (pinned if asked and
    CUDA is available: page-locked memory is page-aligned)."""
    size = round_up(max(nbytes, 1))
    if pin and torch.cuda.is_available():
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)
    raw = torch.empty(size + ALIGN, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % ALIGN
    return raw[shift:shift + size]


def _span(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor ``t`` as a writable memoryview."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("the swapper moves contiguous host tensors only")
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


def _room(t: torch.Tensor) -> int:
    """Bytes available from ``t``'s first byte to the end of its storage."""
    return t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()


class Handle:
    """One transfer in flight; :meth:`wait` returns when it is done or raises naming the file."""

    def __init__(self, path: str, op: str, futures: list[Future[int]], expected: list[int]) -> None:
        self.path, self.op, self.futures, self.expected = path, op, futures, expected

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        errors: list[str] = []
        for f, want in zip(self.futures, self.expected):
            try:
                got = f.result()
            except OSError as exc:
                errors.append(f"{exc.strerror or exc} (errno {exc.errno})")
                continue
            if got < want:
                errors.append(f"short {self.op}: {got} of {want} bytes")
        if errors:
            raise OffloadIOError(self.path, self.op, errors[0])


class _Done(Handle):
    def __init__(self) -> None:
        super().__init__("", "", [], [])


class AsyncSwapper:
    """Named tensors in files under ``directory`` (a fresh private subdirectory is created in it)."""

    def __init__(self, directory: str, block_size: int = 1 << 20, threads: int = 1, direct: bool = True,
                 prefix: str = "zerospeed_swap_") -> None:
        if block_size % ALIGN:
            raise ValueError(f"block_size must be a multiple of {ALIGN}, got {block_size}")
        self.root = tempfile.mkdtemp(prefix=prefix, dir=directory)
        self.block_size = block_size
        self.direct = direct and hasattr(os, "O_DIRECT") and _direct_works(self.root)
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="zerospeed-swap")
        self.sizes: dict[str, int] = {}  # bytes last written to each name (what a read must find)
        self._fds: dict[tuple[str, bool], int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0
        self._finalizer = weakref.finalize(self, _cleanup, self.pool, self._fds, self.root)
        atexit.register(self._finalizer)

    def path(self, name: str) -> str:
        if "/" in name or name.startswith("."):
            raise ValueError(f"swap name {name!r} must be a plain file name")
        return os.path.join(self.root, name + ".swp")

    def _fd(self, name: str, direct: bool) -> int:
        key = (name, direct)
        with self._lock:
            if key not in self._fds:
                flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
                try:
                    self._fds[key] = os.open(self.path(name), flags, 0o600)
                except OSError as exc:
                    raise OffloadIOError(self.path(name), "open", f"{exc.strerror} (errno {exc.errno})") from exc
            return self._fds[key]

    def _can_direct(self, t: torch.Tensor) -> bool:
        return self.direct and t.data_ptr() % ALIGN == 0 and _room(t) >= round_up(t.nbytes)

    def _submit(self, name: str, t: torch.Tensor, write: bool) -> Handle:
        direct = self._can_direct(t)
        fd = self._fd(name, direct)
        total = round_up(t.nbytes) if direct else t.nbytes
        view = _whole(t, total) if direct else _span(t)
        futures, expected = [], []
        fn = _pwrite if write else _pread
        for off in range(0, total, self.block_size):
            piece = view[off:off + self.block_size]
            futures.append(self.pool.submit(fn, fd, piece, off))
            # A direct transfer moves whole 4 KiB pages; only the tensor's own bytes must arrive.
            expected.append(len(piece) if write else min(len(piece), t.nbytes - off))
        return Handle(self.path(name), "write" if write else "read", futures, expected)

    def write(self, name: str, t: torch.Tensor) -> Handle:
        """Start writing host tensor ``t`` (contiguous) to ``name``; keep ``t`` unchanged until ``wait``."""
        handle = self._submit(name, t, write=True)
        self.sizes[name] = t.nbytes
        self.bytes_written += t.nbytes
        return handle

    def read(self, name: str, t: torch.Tensor) -> Handle:
        """Start reading ``name`` into ``t``; ``t`` must have the size it was written with."""
        if name not in self.sizes:
            raise OffloadIOError(self.path(name), "read", "nothing was written under this name")
        if self.sizes[name] != t.nbytes:
            raise OffloadIOError(self.path(name), "read", f"{t.nbytes} bytes asked, {self.sizes[name]} written")
        try:
            on_disk = os.stat(self.path(name)).st_size
        except OSError as exc:
            raise OffloadIOError(self.path(name), "read", f"{exc.strerror} (errno {exc.errno})") from exc
        if on_disk < t.nbytes:
            raise OffloadIOError(self.path(name), "read", f"file holds {on_disk} bytes, {t.nbytes} expected "
                                 "(truncated?)")
        self.bytes_read += t.nbytes
        return self._submit(name, t, write=False)

    def read_range(self, name: str, byte_offset: int, out: torch.Tensor) -> None:
        """Synchronously read ``out.nbytes`` bytes at ``byte_offset`` (through the page cache)."""
        if name not in self.sizes or byte_offset + out.nbytes > self.sizes[name]:
            raise OffloadIOError(self.path(name), "read", f"bytes {byte_offset}..{byte_offset + out.nbytes} were "
                                 "never written")
        got = _pread(self._fd(name, False), _span(out), byte_offset)
        if got != out.nbytes:
            raise OffloadIOError(self.path(name), "read", f"short read: {got} of {out.nbytes} bytes")

    def write_range(self, name: str, byte_offset: int, src: torch.Tensor) -> None:
        """Synchronously overwrite ``src.nbytes`` bytes at ``byte_offset`` of an existing file."""
        if name not in self.sizes or byte_offset + src.nbytes > self.sizes[name]:
            raise OffloadIOError(self.path(name), "write", "range outside what was written")
        got = _pwrite(self._fd(name, False), _span(src.contiguous()), byte_offset)
        if got != src.nbytes:
            raise OffloadIOError(self.path(name), "write", f"short write: {got} of {src.nbytes} bytes")

    def disk_bytes(self) -> int:
        return sum(round_up(n) for n in self.sizes.values())

    def close(self) -> None:
        """Finish pending transfers, close the files and remove the directory."""
        self._finalizer()


def _whole(t: torch.Tensor, nbytes: int) -> memoryview:
    """``nbytes`` bytes starting at ``t``'s first byte (``t`` sits in a larger aligned buffer)."""
    base = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), t.storage_offset() * t.element_size(),
                                                  (nbytes,))
    return memoryview(base.numpy()).cast("B")


def _pwrite(fd: int, buf: memoryview, offset: int) -> int:
    done = 0
    while done < len(buf):
        n = os.pwritev(fd, [buf[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def _pread(fd: int, buf: memoryview, offset: int) -> int:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def _direct_works(directory: str) -> bool:
    """Whether this file system accepts O_DIRECT (tmpfs, for one, does not)."""
    probe = os.path.join(directory, ".direct_probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buf = aligned_empty(ALIGN)
        return os.pwritev(fd, [memoryview(buf.numpy())], 0) == ALIGN
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)


def _cleanup(pool: ThreadPoolExecutor, fds: dict[tuple[str, bool], int], root: str) -> None:
    pool.shutdown(wait=True)
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    shutil.rmtree(root, ignore_errors=True)
