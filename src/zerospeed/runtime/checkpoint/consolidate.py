"""``to-fp32``: one safetensors file of the full model from a checkpoint, without starting ranks.

Streamed: the output header is written first (shapes and dtypes are in ``meta.json``), then each tensor
is assembled from its pieces in the rank files, cast, written and dropped, so memory holds one tensor at
a time (files are read with plain reads, not mapped). The keys are the module's ``state_dict`` keys, so
``model.load_state_dict(safetensors.torch.load_file(out))`` works, and a Hugging Face model directory
with this file as ``model.safetensors`` loads with ``from_pretrained``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from . import layout
from .errors import CheckpointError
from .tensor_file import TensorReader, TensorSpec, TensorWriter
from .universal import CheckpointReader
from ...parallel.tensor.checkpoint import TPReader, saved_shape

DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
               "fp16": torch.float16, "float16": torch.float16}


def verify_checkpoint(checkpoint_dir: str, tag: str | None = None) -> str:
    """Resolve ``tag`` (default ``latest``) and check every file against the manifest; returns the path."""
    ckpt = layout.resolve(os.fspath(checkpoint_dir), tag)
    if ckpt is None:
        raise CheckpointError(f"no checkpoint in {checkpoint_dir}: no 'latest' file (pass a tag)")
    layout.verify_files(ckpt, layout.read_manifest(ckpt))
    return ckpt


def _out_dtype(saved: torch.dtype, target: torch.dtype) -> torch.dtype:
    return target if saved.is_floating_point else saved


def consolidate(checkpoint_dir: str, output: str, tag: str | None = None, dtype: str = "fp32",
                verify: bool = True) -> dict[str, Any]:
    """Write the full model as one safetensors file; returns ``{"path", "tensors", "bytes"}``.

    ``output`` may be a directory (then ``model.safetensors`` inside it). Floating tensors are written in
    ``dtype`` (fp32 by default: the fp32 master weights, exact); integer buffers keep their dtype.
    """
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
    target = DTYPE_NAMES[dtype]
    ckpt = verify_checkpoint(checkpoint_dir, tag) if verify else layout.resolve(os.fspath(checkpoint_dir), tag)
    if ckpt is None:
        raise CheckpointError(f"no checkpoint in {checkpoint_dir}")
    meta = layout.read_json(os.path.join(ckpt, layout.META))
    index = layout.read_json(os.path.join(ckpt, layout.INDEX))
    output = os.fspath(output)
    if os.path.isdir(output):
        output = os.path.join(output, "model.safetensors")
    if not output.endswith(".safetensors"):
        raise ValueError(f"output {output!r} must end with .safetensors (or be a directory)")
    entries: dict[str, Any] = meta["tensors"]
    specs = []
    for key, e in entries.items():
        if entries[e.get("alias_of", key)]["source"] == "excluded":
            continue  # saved with exclude_frozen_parameters: the frozen base model is not in the checkpoint
        saved = getattr(torch, entries[e.get("alias_of", key)]["dtype"])
        if entries[e.get("alias_of", key)]["source"] == "master":
            saved = torch.float32
        shape = saved_shape(entries[e.get("alias_of", key)], False)  # tensor-parallel shards: the original layout
        specs.append(TensorSpec(key, _out_dtype(saved, target), tuple(shape)))
    reader = TPReader(CheckpointReader(ckpt, index), entries, None)  # reassembles tensor-parallel shards
    part = output + ".part.safetensors"
    try:
        with TensorReader(os.path.join(ckpt, layout.MODULE_FILE)) as module_file:
            writer = TensorWriter(part, specs, {"format": "pt"})
            for spec in specs:
                base = entries[spec.key].get("alias_of", spec.key)
                if entries[base]["source"] == "master":
                    t = reader.read_range(f"master/{base}", 0, _numel(spec.shape)).view(spec.shape)
                elif base in module_file.entries:
                    t = module_file.read(base)
                elif reader.has(f"module/{base}"):  # written by its pipeline stage (checkpoint.parallel_write)
                    t = reader.read_range(f"module/{base}", 0, _numel(spec.shape)).view(spec.shape)
                else:
                    raise CheckpointError(f"checkpoint {ckpt} has no data for {base!r}")
                writer.write(spec.key, t.to(spec.dtype))
                del t
            size, _ = writer.close()
        os.replace(part, output)
    finally:
        reader.close()
        if os.path.exists(part):
            os.remove(part)
    return {"path": output, "tensors": len(specs), "bytes": size}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
