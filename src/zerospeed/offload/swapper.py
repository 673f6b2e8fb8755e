"""Asynchronous tensor swapper: whole host buffers to and from files, on a thread pool.

Each transfer is cut into ``block_size`` pieces (requests) that the pool's ``threads`` workers move with
``os.pwritev`` / ``os.preadv`` (which release the GIL), so a read of the next buffer and a write of the
previous one proceed while the caller computes. At most ``queue_depth`` requests are in flight (handed
to the workers) at a time; the others wait in a FIFO and are issued as earlier ones complete, so the
caller never blocks on submission. Files are opened with ``O_DIRECT`` when the file system allows it
and the buffer's address is 4 KiB-aligned (see :func:`aligned_empty`); otherwise through the page cache.
A direct transfer moves whole 4 KiB pages: the tensor's last partial page goes through a one-page
bounce buffer, so a read never writes past the end of its target tensor.

Every transfer is length-checked: a short, failed or never-written read raises :class:`OffloadIOError`
naming the file, and the caller's buffer must then be considered garbage. A transfer of a file that
conflicts with one still in flight (a read or write while it is being written, a write while it is
being read) is refused with :class:`OffloadIOError`: the caller must wait for the earlier handle first,
so a read never silently returns stale or half-written bytes. Files live in a private directory that
:meth:`AsyncSwapper.close` (also run at exit) removes.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from ..accelerator import can_pin_memory

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
    if pin and can_pin_memory():
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)
    raw = torch.empty(size + ALIGN, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % ALIGN
    return raw[shift:shift + size]


def _span(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor ``t`` as a writable memoryview."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("the swapper moves contiguous host tensors only")
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


class _Requests:
    """The FIFO of requests and the count in flight: at most ``depth`` are handed to the pool at once."""

    def __init__(self, threads: int, depth: int) -> None:
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="zerospeed-swap")
        self.depth = max(1, depth)
        self.waiting: deque[tuple[Callable[..., int], tuple[Any, ...], Future[int]]] = deque()
        self.cond = threading.Condition()
        self.in_flight = 0
        self.max_in_flight = 0  # high-water mark, for tests and diagnostics
        self.running = 0
        self.max_running = 0  # requests executing at the same moment (<= min(threads, depth))

    def submit(self, fn: Callable[..., int], *args: Any) -> Future[int]:
        fut: Future[int] = Future()
        with self.cond:
            self.waiting.append((fn, args, fut))
        self._admit()
        return fut

    def _admit(self) -> None:
        while True:
            with self.cond:
                if not self.waiting or self.in_flight >= self.depth:
                    return
                item = self.waiting.popleft()
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.pool.submit(self._run, *item)

    def _run(self, fn: Callable[..., int], args: tuple[Any, ...], fut: Future[int]) -> None:
        with self.cond:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the waiter, who raises OffloadIOError naming the file
            with self.cond:
                self.running -= 1
                self.in_flight -= 1
                self.cond.notify_all()
            fut.set_exception(exc)
        else:
            with self.cond:
                self.running -= 1
                self.in_flight -= 1
                self.cond.notify_all()
            fut.set_result(result)
        self._admit()

    def drain(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: not self.waiting and self.in_flight == 0)
        self.pool.shutdown(wait=True)


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
                 prefix: str = "zerospeed_swap_", queue_depth: int = 8) -> None:
        if block_size % ALIGN:
            raise ValueError(f"block_size must be a multiple of {ALIGN}, got {block_size}")
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be at least 1, got {queue_depth}")
        self.root = tempfile.mkdtemp(prefix=prefix, dir=directory)
        self.block_size = block_size
        self.direct = direct and hasattr(os, "O_DIRECT") and _direct_works(self.root)
        self.requests = _Requests(threads, queue_depth)
        self.sizes: dict[str, int] = {}  # bytes last written to each name (what a read must find)
        self.busy: dict[str, list[Handle]] = {}  # transfers started on each name, not known done (a guard)
        self._fds: dict[tuple[str, bool], int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0
        self._finalizer = weakref.finalize(self, _cleanup, self.requests, self._fds, self.root)
        atexit.register(self._finalizer)

    @property
    def max_in_flight(self) -> int:
        """The most requests that were ever in flight at once (never above ``queue_depth``)."""
        return self.requests.max_in_flight

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

    def _guard(self, name: str, op: str) -> None:
        """Refuse a transfer that conflicts with one in flight on the same file (reads may overlap)."""
        live = [h for h in self.busy.get(name, []) if not h.done()]
        self.busy[name] = live
        for prev in live:
            if op == "write" or prev.op == "write":
                raise OffloadIOError(self.path(name), op, f"a {prev.op} of this file is still in flight; wait for "
                                     "its handle first (the bytes would be stale or half-written)")

    def _submit(self, name: str, t: torch.Tensor, write: bool, base: int = 0) -> Handle:
        op = "write" if write else "read"
        self._guard(name, op)
        direct = self.direct and t.data_ptr() % ALIGN == 0 and base % ALIGN == 0
        fd = self._fd(name, direct)
        span = _span(t)
        body = t.nbytes // ALIGN * ALIGN if direct else t.nbytes
        futures, expected = [], []
        fn = _pwrite if write else _pread
        for off in range(0, body, self.block_size):
            piece = span[off:min(off + self.block_size, body)]
            futures.append(self.requests.submit(fn, fd, piece, base + off))
            expected.append(len(piece))
        if body < t.nbytes:  # direct: the last partial page through a bounce page, never past the tensor
            futures.append(self.requests.submit(_bounce, fd, span[body:], base + body, write))
            expected.append(t.nbytes - body)
        handle = Handle(self.path(name), op, futures, expected)
        self.busy.setdefault(name, []).append(handle)
        return handle

    def write(self, name: str, t: torch.Tensor, offset: int | None = None) -> Handle:
        """Start writing host tensor ``t`` (contiguous) to ``name``: the whole file, or with ``offset`` (bytes)
        a region of an existing file. Keep ``t`` unchanged until ``wait``."""
        if offset is not None:
            if name not in self.sizes or offset < 0:
                raise OffloadIOError(self.path(name), "write", "a region can only be written into an existing file")
            self._check_size(name, "write", self.sizes[name])  # writing would hide a truncation
        handle = self._submit(name, t, write=True, base=offset or 0)
        self.sizes[name] = t.nbytes if offset is None else max(self.sizes[name], offset + t.nbytes)
        self.bytes_written += t.nbytes
        return handle

    def read(self, name: str, t: torch.Tensor, offset: int | None = None) -> Handle:
        """Start reading ``name`` into ``t``: the whole file (``t`` must have the size it was written with), or
        with ``offset`` (bytes) a region of it."""
        if name not in self.sizes:
            raise OffloadIOError(self.path(name), "read", "nothing was written under this name")
        if offset is None and self.sizes[name] != t.nbytes:
            raise OffloadIOError(self.path(name), "read", f"{t.nbytes} bytes asked, {self.sizes[name]} written")
        end = (offset or 0) + t.nbytes
        if offset is not None and (offset < 0 or end > self.sizes[name]):
            raise OffloadIOError(self.path(name), "read", f"bytes {offset}..{end} were never written")
        self._guard(name, "read")
        self._check_size(name, "read", end)
        self.bytes_read += t.nbytes
        return self._submit(name, t, write=False, base=offset or 0)

    def _check_size(self, name: str, op: str, need: int) -> None:
        try:
            on_disk = os.stat(self.path(name)).st_size
        except OSError as exc:
            raise OffloadIOError(self.path(name), op, f"{exc.strerror} (errno {exc.errno})") from exc
        if on_disk < need:
            raise OffloadIOError(self.path(name), op, f"file holds {on_disk} bytes, {need} expected (truncated?)")

    def allocate(self, name: str, nbytes: int) -> None:
        """Create ``name`` holding ``nbytes`` zero bytes without writing them (space reserved with
        ``posix_fallocate``: a fresh optimizer state of zeros costs no I/O)."""
        self._guard(name, "write")
        fd = self._fd(name, False)
        try:
            os.ftruncate(fd, 0)
            os.posix_fallocate(fd, 0, round_up(max(nbytes, 1)))
        except OSError as exc:
            raise OffloadIOError(self.path(name), "allocate", f"{exc.strerror} (errno {exc.errno})") from exc
        self.sizes[name] = nbytes

    def read_range(self, name: str, byte_offset: int, out: torch.Tensor) -> None:
        """Synchronously read ``out.nbytes`` bytes at ``byte_offset`` (through the page cache)."""
        if name not in self.sizes or byte_offset + out.nbytes > self.sizes[name]:
            raise OffloadIOError(self.path(name), "read", f"bytes {byte_offset}..{byte_offset + out.nbytes} were "
                                 "never written")
        self._guard(name, "read")
        got = _pread(self._fd(name, False), _span(out), byte_offset)
        self.bytes_read += got
        if got != out.nbytes:
            raise OffloadIOError(self.path(name), "read", f"short read: {got} of {out.nbytes} bytes")

    def write_range(self, name: str, byte_offset: int, src: torch.Tensor) -> None:
        """Synchronously overwrite ``src.nbytes`` bytes at ``byte_offset`` of an existing file."""
        if name not in self.sizes or byte_offset + src.nbytes > self.sizes[name]:
            raise OffloadIOError(self.path(name), "write", "range outside what was written")
        self._guard(name, "write")
        got = _pwrite(self._fd(name, False), _span(src.contiguous()), byte_offset)
        self.bytes_written += got
        if got != src.nbytes:
            raise OffloadIOError(self.path(name), "write", f"short write: {got} of {src.nbytes} bytes")

    def disk_bytes(self) -> int:
        return sum(round_up(n) for n in self.sizes.values())

    def close(self) -> None:
        """Finish pending transfers, close the files and remove the directory."""
        self._finalizer()


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


def _bounce(fd: int, span: memoryview, offset: int, write: bool) -> int:
    """Move ``len(span)`` (< 4 KiB) bytes at page-aligned ``offset`` of a direct file through one aligned
    page, so only the tensor's own bytes are touched; a write pads the page with zeros."""
    page = aligned_empty(ALIGN)
    view = memoryview(page.numpy()).cast("B")
    n = len(span)
    if write:
        page.zero_()
        view[:n] = span
        return min(n, _pwrite(fd, view, offset))
    got = _pread(fd, view, offset)
    span[: min(n, got)] = view[: min(n, got)]
    return min(n, got)


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


def _cleanup(requests: _Requests, fds: dict[tuple[str, bool], int], root: str) -> None:
    requests.drain()
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    shutil.rmtree(root, ignore_errors=True)
