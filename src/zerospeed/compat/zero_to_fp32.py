"""``deepspeed.utils.zero_to_fp32``: DeepSpeed's consolidation helpers over zerospeed's ``to-fp32``
(``runtime/checkpoint/consolidate.py``), which assembles the fp32 master of every parameter, whatever the
ZeRO stage or world size that wrote the checkpoint.

The state dict comes back with the module's ``state_dict`` keys, as DeepSpeed's does. DeepSpeed's own
ZeRO checkpoints are read by ``zerospeed convert-deepspeed`` first; these helpers read zerospeed's.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
from typing import Any

import torch

from ..runtime.checkpoint.consolidate import consolidate


def get_optim_files(checkpoint_dir: str) -> list[str]:
    """The ``*_optim_states.pt`` files of a checkpoint directory, in natural order (rank 2 before rank 10)."""
    files = glob.glob(os.path.join(os.fspath(checkpoint_dir), "*_optim_states.pt"))
    if not files:
        raise FileNotFoundError(f"can't find '*_optim_states.pt' files in directory '{checkpoint_dir}'")

    def natural(path: str) -> list[Any]:
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]

    return sorted(files, key=natural)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The whole model in fp32, on the CPU, from a checkpoint directory (``tag`` default: ``latest``).

    Frozen parameters are in it unless the checkpoint was saved without them; ``lazy_mode`` is accepted and
    the tensors are materialised (zerospeed streams them one at a time from the rank files)."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        out = consolidate(checkpoint_dir, os.path.join(tmp, "model.safetensors"), tag=tag)
        return dict(load_file(out["path"]))


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str, max_shard_size: str = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Write the fp32 model into ``output_dir``: ``model.safetensors`` with ``safe_serialization``, else
    ``pytorch_model.bin``, as DeepSpeed names them (one file: ``max_shard_size`` is not applied)."""
    os.makedirs(output_dir, exist_ok=True)
    if safe_serialization:
        consolidate(checkpoint_dir, os.path.join(output_dir, "model.safetensors"), tag=tag)
        return
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    torch.save(state, os.path.join(output_dir, "pytorch_model.bin"))


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: str | None = None) -> torch.nn.Module:
    """Load the checkpoint's fp32 weights into ``model`` (on the CPU, strict=False as DeepSpeed) and return it."""
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=False)
    return model


__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "get_optim_files", "load_state_dict_from_zero_checkpoint"]
