"""Checks of an ``nvme_path`` before training starts: it exists, is a directory, is writable, has room."""

from __future__ import annotations

import os
import shutil
import uuid

from ..config import ConfigError

GiB = 1 << 30
HEADROOM = 1.05  # ask for 5% more than the swap files need


def free_bytes(path: str) -> int:
    return shutil.disk_usage(path).free


def readable_size(n: float) -> str:
    """Bytes in the largest unit that keeps the number >= 1 (``10.00 GiB``, ``13.1 KiB``, ``1000 B``)."""
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def check_nvme_path(path: str | None, need_bytes: int, key: str) -> str:
    """Return the absolute directory, or raise ``ConfigError`` naming ``key`` and the fix."""
    if not path:
        raise ConfigError(key, "device 'nvme' needs nvme_path: a directory on a fast local disk")
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
        raise ConfigError(key, f"nvme_path {full!r} does not exist; create the directory (on a local NVMe disk) "
                               "or point nvme_path at one")
    if not os.path.isdir(full):
        raise ConfigError(key, f"nvme_path {full!r} is not a directory")
    probe = os.path.join(full, f".zerospeed_probe_{uuid.uuid4().hex}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
    except OSError as exc:
        raise ConfigError(key, f"nvme_path {full!r} is not writable ({exc.strerror}); pick a directory this "
                               "process can write, or fix its permissions") from None
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    free = free_bytes(full)
    if free < need_bytes * HEADROOM:
        raise ConfigError(key, f"nvme_path {full!r} has {readable_size(free)} free but offload needs "
                               f"{readable_size(need_bytes * HEADROOM)} (swap files plus 5%; GiB free: "
                               f"{free / GiB:.3g} of {need_bytes * HEADROOM / GiB:.3g} needed); free space or use a "
                               "larger disk")
    return full
