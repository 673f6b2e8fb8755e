"""``deepspeed.utils.torch``: the torch version gate DeepSpeed's code and tests call."""

from __future__ import annotations

import torch
from packaging.version import Version


def required_torch_version(min_version: str | float | None = None, max_version: str | float | None = None) -> bool:
    """True when the installed torch is within ``[min_version, max_version]`` (either bound may be omitted)."""
    if not (min_version or max_version):
        raise ValueError("required_torch_version needs a min_version or a max_version")
    installed = Version(Version(torch.__version__).base_version)
    if min_version and Version(str(min_version)) > installed:
        return False
    return not (max_version and Version(str(max_version)) < installed)


__all__ = ["required_torch_version"]
