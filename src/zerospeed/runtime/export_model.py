"""``engine.save_16bit_model``: the whole model in its compute dtype as one safetensors file, on one rank.

* plain / ZeRO 0-3: ``zero.stage3.save_16bit_model`` over the data-parallel group (stage 3 gathers, which needs
  ``stage3_gather_16bit_weights_on_model_save: true`` as in DeepSpeed);
* expert parallelism (ep > 1): every expert under its global id (``parallel/expert/checkpoint.with_all_experts``:
  the first rank of each expert-data group sends its experts);
* AutoTP (tensor parallelism, ZeRO 0-2): the split layers joined over the tensor group
  (``parallel/tensor/export.full_state_dict``), experts then gathered over the world (AutoEP folding: expert groups
  span the tensor groups); global rank 0 writes. Without this every tensor rank wrote its own shards to the same
  file.
"""

from __future__ import annotations

import os
from typing import Any

from .. import comm
from ..config import ConfigError


def save_16bit(engine: Any, save_dir: str, save_filename: str, exclude_frozen_parameters: bool) -> bool:
    """Collective over the engine's ranks; True on the rank that wrote the file."""
    from ..zero.stage3 import full_state_dict, save_16bit_model, save_safetensors

    if engine.zero3 is not None and not engine.zero3.gather_16bit_on_save:
        raise ConfigError("zero_optimization.stage3_gather_16bit_weights_on_model_save",
                          "under ZeRO stage 3 saving a 16-bit model gathers the partitioned parameters; set it "
                          "to true (or export with zerospeed.zero.full_state_dict)")
    sharded = engine.parts.experts_sharded  # each rank holds only its own experts
    if (sharded or engine.tensor_parallel is not None) and exclude_frozen_parameters:
        raise NotImplementedError("save_16bit_model(exclude_frozen_parameters=True) with expert or tensor "
                                  "parallelism is not supported yet by zerospeed")
    if engine.tensor_parallel is not None:
        from ..parallel.tensor.export import full_state_dict as tensor_full_state_dict

        state = tensor_full_state_dict(engine.module)  # collective over the tensor group
        writer = comm.get_rank() == 0
        if sharded:
            from ..parallel.expert.checkpoint import with_all_experts

            state = with_all_experts(state if writer else {}, engine.module, None)
        if writer:
            save_safetensors(state, os.path.join(save_dir, save_filename))
        return writer
    if sharded:
        from ..parallel.expert.checkpoint import with_all_experts

        state = with_all_experts(full_state_dict(engine.module, group=engine.dp_group), engine.module,
                                 engine.dp_group)
        if comm.get_rank(engine.dp_group) == 0:
            save_safetensors(state, os.path.join(save_dir, save_filename))
        return comm.get_rank(engine.dp_group) == 0
    return save_16bit_model(engine.module, save_dir, save_filename, group=engine.dp_group,
                            exclude_frozen_parameters=exclude_frozen_parameters)
