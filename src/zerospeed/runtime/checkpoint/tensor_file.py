"""Streaming reader and writer of safetensors files: no pickle, no mmap, one tensor in memory at a time.

The format (https://github.com/huggingface/safetensors) is an 8-byte little-endian header length, a JSON
header ``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`` padded
with spaces to a multiple of 8, then the tensors' raw little-endian bytes, back to back in header order.

We write it ourselves so that a file can be produced while its tensors are still being assembled (the
header only needs shapes and dtypes) and hashed as it is written, and read it ourselves so that ranges
of one tensor are read with plain file reads (a loader resharding to a new world size reads only the
elements it owns; a consolidator's memory stays one tensor, not the pages of a mapped file).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from .errors import CheckpointError
from .writer import open_sink

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
NAMES: dict[str, torch.dtype] = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 64 * 1024 * 1024
_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class TensorSpec:
    """What the header needs to know about one tensor before its bytes exist."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class TensorWriter:
    """Write tensors in the order of ``specs``; ``close()`` fsyncs and returns ``(bytes, sha256)``.
    ``writer``: the ``checkpoint.writer`` section (how the bytes are written: ``writer.py``), None: inline."""

    def __init__(self, path: str, specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None,
                 writer: Any = None) -> None:
        if path.endswith(".safetensors") is False:
            raise ValueError(f"tensor file names end with .safetensors, got {path!r}")
        self.path = path
        self._specs = list(specs)
        self._next = 0
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for s in self._specs:
            if s.dtype not in DTYPES:
                raise ValueError(f"{s.key}: dtype {s.dtype} cannot be stored in safetensors")
            header[s.key] = {"dtype": DTYPES[s.dtype], "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
            offset += s.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._sink = open_sink(path, writer)
        self._sink.put(struct.pack("<Q", len(blob)) + blob)

    def write(self, key: str, t: torch.Tensor) -> None:
        spec = self._specs[self._next] if self._next < len(self._specs) else None
        if spec is None or spec.key != key:
            raise RuntimeError(f"{self.path}: expected tensor {spec.key if spec else '(none)'}, got {key}")
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            raise RuntimeError(f"{self.path}: {key} is {t.dtype}{tuple(t.shape)}, header says {spec.dtype}{spec.shape}")
        self._sink.put_tensor(t)
        self._next += 1

    def close(self) -> tuple[int, str]:
        if self._next != len(self._specs):
            self.abort()
            raise RuntimeError(f"{self.path}: {len(self._specs) - self._next} tensors were never written")
        return self._sink.close()

    def abort(self) -> None:
        """Stop writing (the file is left incomplete; a staging directory is removed by its owner)."""
        self._sink.abort()


def write_tensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                  writer: Any = None) -> tuple[int, str]:
    """Write a whole dict of tensors; returns ``(bytes, sha256)`` of the file (``writer``: see TensorWriter)."""
    w = TensorWriter(path, [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], metadata, writer)
    try:
        for k, t in tensors.items():
            w.write(k, t)
    except BaseException:
        w.abort()
        raise
    return w.close()


class TensorReader:
    """Random access to the tensors of one safetensors file; every malformed header names the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._f: BinaryIO = open(path, "rb")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            raise CheckpointError(f"cannot open checkpoint file {path}: {exc}") from None
        size = os.fstat(self._f.fileno()).st_size
        head = self._f.read(8)
        if len(head) != 8:
            self._bad("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            self._bad(f"header length {n} does not fit a file of {size} bytes")
        try:
            header = json.loads(self._f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            self._bad(f"header is not JSON ({exc})")
        if not isinstance(header, dict):
            self._bad("header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._base = 8 + n
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for key, info in header.items():
            try:
                dtype = NAMES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                self._bad(f"entry {key!r} is malformed")
            spec = TensorSpec(key, dtype, shape)
            if end - begin != spec.nbytes or begin < 0 or self._base + end > size:
                self._bad(f"entry {key!r} has offsets {begin}..{end} outside the file or not matching its shape")
            self.entries[key] = (dtype, shape, begin, end)

    def _bad(self, why: str) -> None:
        self._f.close()
        raise CheckpointError(f"checkpoint file {self.path} is not a valid safetensors file: {why}")

    def keys(self) -> list[str]:
        return list(self.entries)

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor, with its shape."""
        dtype, shape, _, _ = self._entry(key)
        n = 1
        for d in shape:
            n *= d
        return self.read_range(key, 0, n).view(shape)

    def read_range(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor (a new 1-D tensor)."""
        dtype, _, begin, end = self._entry(key)
        item = torch.empty((), dtype=dtype).element_size()
        if not 0 <= lo <= hi <= (end - begin) // item:
            raise CheckpointError(f"{self.path}: range {lo}..{hi} outside tensor {key!r}")
        buf = torch.empty((hi - lo) * item, dtype=torch.uint8)
        if hi > lo:
            self._f.seek(self._base + begin + lo * item)
            got = self._f.readinto(buf.numpy())
            if got != buf.numel():
                raise CheckpointError(f"checkpoint file {self.path} is truncated inside tensor {key!r}")
        return buf.view(dtype)

    def _entry(self, key: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        if key not in self.entries:
            raise CheckpointError(f"checkpoint file {self.path} has no tensor {key!r}")
        return self.entries[key]

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
