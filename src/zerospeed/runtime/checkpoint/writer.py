"""Where a tensor file's bytes go: DeepSpeed's ``checkpoint.writer`` types over zerospeed's safetensors files.

A :class:`TensorWriter` (``tensor_file``) hands every piece of the file to a sink, which writes it, hashes it
(sha256, for the manifest) and counts it; ``close`` makes the file durable (fsync) and returns
``(bytes, sha256)``. The file format and the commit protocol do not depend on the sink.

- :class:`InlineSink` (``writer.type: "python"``, and the default without a ``writer`` section): each piece
  is hashed and written by the caller, one after the other.
- :class:`BufferedSink` (``"fast"``): pieces of at most ``io_buffer_size`` bytes; the caller hashes piece
  ``i + 1`` (and, for a tensor on an accelerator, copies it to the host) while a writer thread writes piece
  ``i``; with ``io_buffer_double`` two pieces are in flight, else one. hashlib and file writes release the
  GIL, so the hash and the write overlap, and host memory for device tensors stays at two pieces. A write
  error in the thread is raised at the next piece or at ``close``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import threading
from typing import Any, BinaryIO

import torch


class InlineSink:
    """Write and hash in the caller's thread (zerospeed's writer)."""

    def __init__(self, path: str) -> None:
        self._f: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._hash = hashlib.sha256()
        self.size = 0

    def put(self, data: bytes | memoryview) -> None:
        self._f.write(data)
        self._hash.update(data)
        self.size += len(data)

    def put_tensor(self, t: torch.Tensor) -> None:
        self.put(_host_bytes(t))

    def close(self) -> tuple[int, str]:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return self.size, self._hash.hexdigest()

    def abort(self) -> None:
        self._f.close()


class BufferedSink:
    """Pieces written by a writer thread while the caller hashes (and copies) the next one."""

    def __init__(self, path: str, buffer_size: int, double: bool) -> None:
        self._f: BinaryIO = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in close()
        self._hash = hashlib.sha256()
        self.size = 0
        self.piece = buffer_size
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=2 if double else 1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="zerospeed-ckpt-writer", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while (piece := self._queue.get()) is not None:
            if self._error is None:
                try:
                    view = memoryview(piece).cast("B")
                    while view:
                        view = view[self._f.write(view):]
                except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                    self._error = exc

    def _raise(self) -> None:
        if self._error is not None:
            raise OSError(f"checkpoint write to {self._f.name} failed: {self._error}") from self._error

    def put(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        for lo in range(0, len(view), self.piece):
            self._raise()
            chunk = view[lo:lo + self.piece]
            self._hash.update(chunk)
            self._queue.put(chunk)  # blocks while the buffers in flight are full
            self.size += len(chunk)

    def put_tensor(self, t: torch.Tensor) -> None:
        flat = t.detach().reshape(-1)
        if flat.device.type == "cpu":
            self.put(_host_bytes(flat))
            return
        step = max(1, self.piece // flat.element_size())  # an accelerator's tensor: a piece at a time to the host
        for lo in range(0, flat.numel(), step):
            self.put(_host_bytes(flat[lo:lo + step]))

    def close(self) -> tuple[int, str]:
        self._queue.put(None)
        self._thread.join()
        try:
            self._raise()
            os.fsync(self._f.fileno())
        finally:
            with contextlib.suppress(OSError):
                self._f.close()
        return self.size, self._hash.hexdigest()

    def abort(self) -> None:
        """Stop: the writer thread ends after the pieces in flight, the file is closed (left incomplete)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        with contextlib.suppress(OSError):
            self._f.close()


def _host_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def open_sink(path: str, writer: Any = None) -> InlineSink | BufferedSink:
    """The sink ``checkpoint.writer`` asks for (None: zerospeed's inline writer)."""
    if writer is None or writer.type == "python":
        return InlineSink(path)
    return BufferedSink(path, writer.io_buffer_size, writer.io_buffer_double)
