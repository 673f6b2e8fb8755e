"""``deepspeed.git_version_info``: the build facts DeepSpeed records at install time, for zerospeed.

zerospeed compiles no ops, so ``installed_ops`` is all False; ``torch_info`` describes the torch in use.
"""

from __future__ import annotations

import torch

from .. import __version__ as version
from .op_builder import ALL_OPS


def _major_minor(v: str | None) -> str:
    return ".".join(v.split(".")[:2]) if v else "0.0"


git_hash = "unknown"
git_branch = "unknown"
installed_ops: dict[str, bool] = dict.fromkeys(ALL_OPS, False)
compatible_ops: dict[str, bool] = {op: b.is_compatible() for op, b in ALL_OPS.items()}
torch_info: dict[str, object] = {
    "version": _major_minor(torch.__version__.split("+")[0]),
    "bf16_support": False,
    "cuda_version": _major_minor(torch.version.cuda),
    "nccl_version": "0.0",
    "hip_version": _major_minor(getattr(torch.version, "hip", None)),
}

__all__ = ["compatible_ops", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]
