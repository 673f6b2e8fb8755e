"""DeepSpeed's (Megatron's) ``MMapIndexedDataset`` files, read and written with numpy: a list of 1-D arrays.

``<prefix>.idx``: magic ``MMIDIDX\\0\\0``, version ``<Q`` 1, dtype code ``<B``, item count ``<Q``, document
count ``<Q``, then the item sizes (int32), byte offsets (int64) and document starts (int64).
``<prefix>.bin``: the items' values back to back. DeepSpeed's data analyzer writes a metric's index as two
such files: ``index_to_sample`` (one item per metric value, ascending: the ids of the samples with that value)
and ``index_to_metric`` (one item per value: the value). ``write_metric_index`` makes the same two files
from per-sample values the user computed, so any metric can drive the curriculum sampler.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

import numpy as np

_MAGIC = b"MMIDIDX\x00\x00"
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.uint16, 7: np.uint32,
           8: np.uint64}
_CODES = {np.dtype(v): k for k, v in _DTYPES.items()}


def read_indexed(prefix: str) -> list[np.ndarray]:
    """The items of ``<prefix>.idx``/``.bin`` (memory-mapped, read-only views)."""
    for ext in (".idx", ".bin"):
        if not os.path.exists(prefix + ext):
            raise FileNotFoundError(f"{prefix}{ext} does not exist (an index written by DeepSpeed's data analyzer "
                                    "or zerospeed.data_pipeline.write_metric_index)")
    with open(prefix + ".idx", "rb") as f:
        if f.read(9) != _MAGIC:
            raise ValueError(f"{prefix}.idx is not an MMapIndexedDataset index (bad magic)")
        (version,) = struct.unpack("<Q", f.read(8))
        if version != 1:
            raise ValueError(f"{prefix}.idx: unsupported index version {version}")
        (code,) = struct.unpack("<B", f.read(1))
        count, _docs = struct.unpack("<QQ", f.read(16))
        offset = f.tell()
    header = np.memmap(prefix + ".idx", mode="r", dtype=np.uint8)
    sizes = np.frombuffer(header, dtype=np.int32, count=count, offset=offset)
    pointers = np.frombuffer(header, dtype=np.int64, count=count, offset=offset + sizes.nbytes)
    dtype = _DTYPES[code]
    data = np.memmap(prefix + ".bin", mode="r", dtype=np.uint8)
    return [np.frombuffer(data, dtype=dtype, count=int(n), offset=int(p)) for n, p in zip(sizes, pointers)]


def write_indexed(prefix: str, items: Sequence[np.ndarray], dtype: type | np.dtype) -> None:
    """Write ``items`` as one document of ``len(items)`` items (what DeepSpeed's builder produces)."""
    dt = np.dtype(dtype)
    if dt not in _CODES:
        raise ValueError(f"dtype {dt} is not one MMapIndexedDataset stores ({sorted(str(d) for d in _CODES)})")
    arrays = [np.asarray(a, dtype=dt).reshape(-1) for a in items]
    sizes = np.array([a.size for a in arrays], dtype=np.int32)
    pointers = np.zeros(len(arrays), dtype=np.int64)
    if len(arrays) > 1:
        pointers[1:] = np.cumsum(sizes[:-1].astype(np.int64) * dt.itemsize)
    with open(prefix + ".bin", "wb") as f:
        for a in arrays:
            f.write(a.tobytes(order="C"))
    with open(prefix + ".idx", "wb") as f:
        f.write(_MAGIC + struct.pack("<Q", 1) + struct.pack("<B", _CODES[dt]))
        f.write(struct.pack("<QQ", len(arrays), 2))
        f.write(sizes.tobytes() + pointers.tobytes() + np.array([0, len(arrays)], dtype=np.int64).tobytes())


def fit_int_dtype(min_value: int, max_value: int) -> type:
    """DeepSpeed's ``find_fit_int_dtype``: the smallest integer type holding the range."""
    if min_value >= 0:
        for t in (np.uint8, np.uint16, np.uint32):
            if max_value <= np.iinfo(t).max:
                return t
        return np.uint64
    for t in (np.int8, np.int16, np.int32):
        if np.iinfo(t).min <= min_value and max_value <= np.iinfo(t).max:
            return t
    return np.int64


def write_metric_index(values: Sequence[float] | np.ndarray, save_path: str, metric_name: str) -> tuple[str, str]:
    """Per-sample metric ``values`` (sample ``i`` has ``values[i]``) as DeepSpeed's analyzer index.

    Returns ``(index_to_sample_path, index_to_metric_path)``, the prefixes to put in the config's
    ``curriculum_metrics.<metric_name>``."""
    vals = np.asarray(values)
    if vals.ndim != 1 or vals.size == 0:
        raise ValueError("write_metric_index(values, ...) expects one metric value per sample (a 1-D sequence)")
    os.makedirs(save_path, exist_ok=True)
    order = np.argsort(vals, kind="stable")
    uniq, starts = np.unique(vals[order], return_index=True)
    rows = np.split(order, starts[1:])
    sample_prefix = os.path.join(save_path, f"{metric_name}_index_to_sample")
    metric_prefix = os.path.join(save_path, f"{metric_name}_index_to_metric")
    write_indexed(sample_prefix, rows, fit_int_dtype(0, vals.size - 1))
    if np.issubdtype(vals.dtype, np.integer):
        metric_dtype: type = fit_int_dtype(int(uniq.min()), int(uniq.max()))
    else:
        raise ValueError("DeepSpeed's index stores integer metric values; round or scale the values first")
    write_indexed(metric_prefix, [np.array([u]) for u in uniq], metric_dtype)
    return sample_prefix, metric_prefix
