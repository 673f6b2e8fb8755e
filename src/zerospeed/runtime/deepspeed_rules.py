"""DeepSpeed 0.19.8 `initialize()` rules on inputs it accepts where a stricter reading would refuse them.

* A client optimizer (or lr scheduler) next to the config's ``optimizer`` (``scheduler``) section: as in
  DeepSpeed's ``_configure_optimizer`` / ``_configure_lr_scheduler`` the client object is used and the
  section is ignored; rank 0 logs one warning naming which is used and which is ignored.
* ``offload_param`` below stage 3: accepted with one log line (DeepSpeed ignores it).
* ``data_parallel_size``: DeepSpeed reads it only together with ``sequence_parallel_size``, building a
  (data, sequence) mesh of that shape, which must cover the world. Alone it has no effect there.
"""

from __future__ import annotations

import logging
from typing import Any

from ..config import ConfigError, ZeroSpeedConfig
from .log import log_dist


def prefer_client_objects(cfg: ZeroSpeedConfig, optimizer: Any, lr_scheduler: Any) -> ZeroSpeedConfig:
    """The config without the sections a client object overrides (one warning per section dropped)."""
    update: dict[str, Any] = {}
    if optimizer is not None and cfg.optimizer is not None:
        log_dist(f"initialize() got a client optimizer ({type(optimizer).__name__}) and a config 'optimizer' "
                 f"section ({cfg.optimizer.type}): using the client optimizer, ignoring the config section "
                 "(DeepSpeed's rule)", level=logging.WARNING)
        update["optimizer"] = None
    if lr_scheduler is not None and cfg.scheduler is not None:
        log_dist(f"initialize() got a client lr_scheduler ({type(lr_scheduler).__name__}) and a config "
                 f"'scheduler' section ({cfg.scheduler.type}): using the client lr_scheduler, ignoring the config "
                 "section (DeepSpeed's rule)", level=logging.WARNING)
        update["scheduler"] = None
    return cfg.model_copy(update=update) if update else cfg


def check_data_parallel_size(cfg: ZeroSpeedConfig, world_size: int) -> None:
    """``data_parallel_size`` x ``sequence_parallel_size`` must be the world (DeepSpeed's mesh); alone, the
    key has no effect (said once when it differs from the world size)."""
    dp = cfg.data_parallel_size
    if dp is None:
        return
    if "sequence_parallel_size" in cfg.model_fields_set:
        sp = cfg.sequence_parallel_size
        if dp * sp != world_size:
            raise ConfigError("data_parallel_size", f"data_parallel_size {dp} x sequence_parallel_size {sp} = "
                              f"{dp * sp}, but the world has {world_size} ranks; the (data, sequence) mesh must "
                              f"cover it: set data_parallel_size to {world_size // sp if world_size % sp == 0 else '?'}")
    elif dp != world_size:
        log_dist(f"data_parallel_size {dp} has no effect without sequence_parallel_size (as in DeepSpeed): the "
                 f"data-parallel size is the world size, {world_size}", level=logging.WARNING)


def note_offload_param_below_stage3(stage: int) -> None:
    """``offload_param`` below stage 3 is accepted, as DeepSpeed accepts it, with one log line saying why it
    does nothing: only stage 3 partitions the parameters that it would offload (build_model decides when)."""
    log_dist(f"zero_optimization.offload_param has no effect at ZeRO stage {stage}: parameters are "
             "offloaded only when stage 3 partitions them (DeepSpeed ignores it too)", level=logging.WARNING)
