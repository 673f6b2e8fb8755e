"""ZeRO stage 3: parameters partitioned too, gathered around each module's forward and backward.

``param_store`` (each parameter's shard and state), ``fetcher`` (gather, release, prefetch in recorded
order), ``hooks`` (module hooks), ``group`` (optimizer group and reducer), ``setup`` (what
``initialize`` calls), ``init`` (``zero.Init``; ``mics_init``: ``MiCS_Init``, refused while enabled),
``gathered`` (``GatheredParameters``), ``export``
(full state dict, 16-bit safetensors), ``lockstep`` (every rank's gathers checked to be the same),
``synced`` (generation loops of per-rank length), ``unwrap`` (gathered once, hooks off, for generation).
"""

from .export import full_state_dict, save_16bit_model, save_safetensors
from .fetcher import Fetcher, Unit
from .gathered import GatheredParameters
from .group import Stage3Group, Stage3Reducer
from .init import Init
from .lockstep import RanksDivergedError
from .mics_init import MiCS_Init
from .sanity import ModifiedWithoutModifierError, SanityCheckError
from .param_store import GatherOp, ParamShard, ShardState, shard_of
from .setup import Stage3Runtime, register_external_parameter, setup_stage3
from .synced import any_rank_running, synced_generate
from .unwrap import unwrap_model_for_generation

__all__ = ["Fetcher", "GatherOp", "GatheredParameters", "Init", "MiCS_Init", "ModifiedWithoutModifierError",
           "ParamShard", "RanksDivergedError", "SanityCheckError", "ShardState",
           "Stage3Group", "Stage3Reducer", "Stage3Runtime", "Unit", "any_rank_running", "full_state_dict",
           "register_external_parameter", "save_16bit_model", "save_safetensors", "setup_stage3", "shard_of",
           "synced_generate", "unwrap_model_for_generation"]
