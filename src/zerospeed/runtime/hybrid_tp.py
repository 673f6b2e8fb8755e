"""Tensor-parallel rollouts (``hybrid_engine.inference_tp_size`` = T > 1): generation split over groups of T
consecutive training ranks, as DeepSpeed's hybrid engine does.

Once per rollout phase the training weights are gathered (ZeRO-3; whole already at stages 0-2), copied into a
fresh instance of the model (``type(module)(module.config)``), and released again; the copy is split for the
inference engine's tensor parallelism (``inference/tensor_parallel.py``: each rank keeps ``1/T`` of every
attention and MLP matrix and of the KV cache), so during the phase a rank holds ``1/T`` of the weights instead of
all of them. Each ``generate()`` all-gathers the prompts of the T ranks (they must have the same shape, as in
DeepSpeed), decodes the joint batch tensor-parallel, and hands each rank the rows of its own prompts::

    ranks [0,1] (T 2):  prompts p0 | p1  --all-gather-->  [p0; p1]  --generate, split weights-->  [o0; o1]  --> o0 | o1

The training module, its optimizer and its RNG are not touched, so a step after a rollout equals one without.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import comm
from ..config.errors import ConfigError
from ..zero.stage3 import GatheredParameters


def rollout_groups(size: int) -> tuple[Any, int]:
    """This rank's group of ``size`` consecutive ranks and its rank in it (collective: every group is created)."""
    world, me = comm.get_world_size(), comm.get_rank()
    if world % size:
        raise ConfigError("hybrid_engine.inference_tp_size", f"{size} must divide the world size {world}; valid: "
                          f"{[d for d in range(1, world + 1) if world % d == 0]}")
    mine = None
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group = comm.new_group(ranks)
        if me in ranks:
            mine = group
    return mine, me % size


def _fresh_copy(module: nn.Module) -> nn.Module:
    """A new instance of the HF model holding the module's (gathered) weights, without random initialisation."""
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError("hybrid_engine.inference_tp_size > 1 needs a Hugging Face model (with a .config) to copy "
                         f"for tensor-parallel generation; {type(module).__name__} has none")
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers: initialise, then overwrite
        from contextlib import nullcontext as no_init_weights  # type: ignore[assignment]
    with no_init_weights():
        fresh = type(module)(config)
    with GatheredParameters(list(module.parameters())):
        fresh.load_state_dict({k: v.detach().clone() for k, v in module.state_dict().items()}, strict=True)
    fresh.generation_config = getattr(module, "generation_config", fresh.generation_config)
    return fresh


class TensorParallelRollout:
    """One engine's tensor-parallel generation: its group, and the split copy of one rollout phase."""

    def __init__(self, module: nn.Module, size: int) -> None:
        self.module = module
        self.size = size
        self.group, self.rank = rollout_groups(size)
        self.engine: Any = None
        self.copies = 0  # split copies made (one per phase): a count for tests and logs

    def _engine(self) -> Any:
        if self.engine is None:
            from ..inference import init_inference

            dtype = next(self.module.parameters()).dtype
            self.engine = init_inference(_fresh_copy(self.module), dtype=dtype,
                                         tensor_parallel={"tp_size": self.size, "tp_group": self.group,
                                                          "tp_grain_size": 1})
            self.copies += 1
        return self.engine

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """This rank's rows of the group's joint greedy/sampled generation."""
        if kwargs.get("do_sample") and kwargs.get("seed") is None:
            raise ValueError("engine.generate(do_sample=True) with hybrid_engine.inference_tp_size > 1 needs seed= "
                             "(the same on the tensor-parallel ranks, so they draw the same tokens)")
        shapes = comm.all_gather_object(tuple(input_ids.shape), group=self.group)
        if any(s != shapes[0] for s in shapes):
            raise ValueError(f"engine.generate() with hybrid_engine.inference_tp_size {self.size}: the prompts of "
                             f"the tensor-parallel ranks must have the same shape (got {shapes}); pad them to one "
                             "length (attention_mask marks the padding)")
        joint = {"input_ids": input_ids, **({"attention_mask": kwargs.pop("attention_mask")}
                                              if kwargs.get("attention_mask") is not None else {})}
        for name, t in list(joint.items()):
            t = t.contiguous().to(comm.device_for_backend(self.group))
            out = t.new_empty((self.size * t.shape[0], *t.shape[1:]))
            comm.all_gather(out, t, group=self.group)
            joint[name] = out.to(input_ids.device)
        engine = self._engine()
        ids = joint.pop("input_ids")
        tokens = engine.generate(ids, **joint, **kwargs)
        b = input_ids.shape[0]
        return tokens[self.rank * b:(self.rank + 1) * b]

    def release(self) -> None:
        self.engine = None
