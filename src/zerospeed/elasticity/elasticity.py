"""Elastic batch sizes: one global batch size that stays valid while the world size changes.

DeepSpeed 0.19.6's algorithm, results and errors (``compute_elastic_config``). The global batch is
``micro * gas * dp``; a batch size ``B`` is *valid* at data-parallel size ``n`` when some acceptable
micro batch ``mb`` divides ``B / n``. Candidates for ``B``: each acceptable micro batch, and their least
common multiple, scaled by the largest highly composite number (many divisors, so many valid ``n``) that
keeps ``B <= max_train_batch_size``. The candidate valid at the most sizes in ``[min_gpus, max_gpus]``
wins; a tie goes to the larger batch (``prefer_larger_batch``) or the smaller.

Version 0.1 counts GPUs. Version 0.2 counts nodes: it solves 0.1 per node (with the batch divided by the
data-parallel ranks per node, ``num_gpus_per_node / model_parallel_size``) and scales back; at a world
size off that list it falls back to the largest (or smallest) multiple of ``mb * dp`` that fits.

One deliberate difference from 0.19.6: version 0.2's micro batch for ``return_microbatch`` divides the
per-*data-parallel-rank* batch (0.19.6 divided by every GPU, off by ``model_parallel_size``; DeepSpeed's
later fix and its test agree with this). And a world size checked against no valid size at all raises
``ElasticityIncompatibleWorldSize`` where 0.19.6 failed with a ``TypeError``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from typing import Any

from ..config.elasticity import (DEEPSPEED_ELASTICITY_CONFIG, LATEST_ELASTICITY_VERSION, MINIMUM_DEEPSPEED_VERSION,
                                 ElasticityConfig, ElasticityConfigError, ElasticityError,
                                 ElasticityIncompatibleWorldSize, parse_elasticity)

_log = logging.getLogger("zerospeed.elasticity")

# The 38 smallest highly composite numbers (OEIS A002182), DeepSpeed's list: batch sizes up to ~720K.
HCN_LIST = (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080,
            15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640,
            498960, 554400, 665280, 720720)


def _largest_hcn_at_most(value: int) -> int:
    """The largest listed HCN <= ``value`` (the last one when ``value`` is beyond the list)."""
    return max(h for h in HCN_LIST if h <= value) if value >= 1 else HCN_LIST[0]


def get_candidate_batch_sizes(base_list: list[int], max_acceptable_batch_size: int) -> list[int]:
    """Each base scaled by the largest HCN keeping it <= the cap; bases above the cap are dropped."""
    out: set[int] = set()
    for base in base_list:
        if base > max_acceptable_batch_size:
            continue
        if base == max_acceptable_batch_size:
            out.add(base)
        else:
            out.add(_largest_hcn_at_most(max_acceptable_batch_size // base) * base)
    return sorted(out)


def get_valid_gpus(batch_size: int, micro_batches: list[int], min_valid_gpus: int, max_valid_gpus: int) -> list[int]:
    """The world sizes in range at which some micro batch divides the per-rank batch."""
    valid: set[int] = set()
    for mb in micro_batches:
        if batch_size % mb:
            continue
        most = batch_size // mb  # one micro batch per rank, no accumulation
        if min_valid_gpus <= most <= max_valid_gpus:
            valid.add(most)
        for n in range(max(1, min_valid_gpus), min(most // 2, max_valid_gpus) + 1):
            if most % n == 0:
                valid.add(n)
    return sorted(valid)


def get_best_candidates(candidate_batch_sizes: list[int], micro_batches: list[int], min_gpus: int, max_gpus: int,
                        prefer_larger: bool) -> tuple[int, list[int] | None]:
    """The candidate valid at the most world sizes; ties by size. ``None`` sizes when nothing beat the
    starting point (the smallest micro batch, valid nowhere)."""
    best_count, best_gpus, best = 0, None, int(min(micro_batches))
    for batch in candidate_batch_sizes:
        gpus = get_valid_gpus(batch, micro_batches, min_gpus, max_gpus)
        better_tie = batch > best if prefer_larger else batch < best
        if len(gpus) > best_count or (len(gpus) == best_count and better_tie):
            best_count, best_gpus, best = len(gpus), gpus, batch
    return best, best_gpus


def _compatible_v01(micro_batches: list[int], max_batch: int, min_gpus: int | None = None,
                    max_gpus: int | None = None, prefer_larger: bool = True) -> tuple[int, list[int] | None]:
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_batch // min(micro_batches)
    if not all(mb <= max_batch for mb in micro_batches):
        raise ElasticityConfigError(f"All micro batches must be less than or equal to max_acceptable_batch_size: "
                                    f"{max_batch}", "elasticity.micro_batch_sizes")
    bases = [*micro_batches, math.lcm(*micro_batches)]
    return get_best_candidates(get_candidate_batch_sizes(bases, max_batch), micro_batches, min_gpus, max_gpus,
                               prefer_larger)


def _pick_micro(batch: int, dp: int, micro_batches: list[int], prefer_larger: bool) -> int | None:
    """Version 0.2's micro batch: among those dividing the per-rank batch, the largest (or the first listed)."""
    fitting = [mb for mb in micro_batches if batch // dp % mb == 0]
    if not fitting:
        return None
    return max(fitting) if prefer_larger else fitting[0]


def _compatible_v02(micro_batches: list[int], max_batch: int, current_num_gpus: int, min_gpus: int, max_gpus: int,
                    prefer_larger: bool, num_gpus_per_node: int,
                    model_parallel_size: int) -> tuple[int, list[int], int | None]:
    if num_gpus_per_node % model_parallel_size:
        raise ElasticityError(f"In Elasticity v0.2, number of GPUs per node:{num_gpus_per_node} should be divisible "
                              f"by model parallel size {model_parallel_size}")
    dp_per_node = num_gpus_per_node // model_parallel_size
    per_node_batch, nodes = _compatible_v01(micro_batches, int(max_batch / dp_per_node),
                                            int(min_gpus / num_gpus_per_node), int(max_gpus / num_gpus_per_node),
                                            prefer_larger)
    batch = int(per_node_batch) * dp_per_node
    valid_dp = [n * dp_per_node for n in nodes or []]
    dp = current_num_gpus // model_parallel_size
    if dp in valid_dp:
        return batch, valid_dp, _pick_micro(batch, dp, micro_batches, prefer_larger)
    # Off the list: the largest (smallest) multiple of micro * dp under the cap, at this size only.
    current_dp = current_num_gpus / num_gpus_per_node * dp_per_node
    sizes = [math.floor(max_batch / float(mb * current_dp)) * mb * current_dp for mb in micro_batches]
    fallback = max(sizes) if prefer_larger else min(sizes)
    # (a world smaller than one model replica, int(current_dp) == 0, is checked as one rank: no crash)
    return fallback, [int(current_dp)], _pick_micro(int(fallback), max(1, int(current_dp)), micro_batches,
                                                    prefer_larger)


def _release(version: str) -> tuple[int, ...]:
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    if m is None:
        raise ElasticityError(f"Target deepspeed version {version!r} is not a version number")
    return tuple(int(p) for p in m.group(1).split("."))


def _check_target_version(target_deepspeed_version: str) -> None:
    if _release(target_deepspeed_version) < _release(MINIMUM_DEEPSPEED_VERSION):
        raise ElasticityError(f"Target deepspeed version of {target_deepspeed_version} is not compatible with "
                              f"minimum version {MINIMUM_DEEPSPEED_VERSION} supporting elasticity.")


def elasticity_enabled(ds_config: dict[str, Any]) -> bool:
    section = ds_config.get("elasticity")
    return bool(isinstance(section, dict) and section.get("enabled", False))


def ensure_immutable_elastic_config(runtime_elastic_config_dict: dict[str, Any]) -> None:
    """The batch-defining keys must equal what the resource scheduler saw (``DEEPSPEED_ELASTICITY_CONFIG``:
    the JSON of the ``elasticity`` section, or of a whole config holding one)."""
    if DEEPSPEED_ELASTICITY_CONFIG not in os.environ:
        _log.warning("Unable to find DEEPSPEED_ELASTICITY_CONFIG environment variable, cannot guarantee resource "
                     "scheduler will scale this job using compatible GPU counts.")
        return
    seen = json.loads(os.environ[DEEPSPEED_ELASTICITY_CONFIG])
    if isinstance(seen, dict) and isinstance(seen.get("elasticity"), dict):
        seen = seen["elasticity"]
    scheduler, runtime = parse_elasticity(seen), parse_elasticity(runtime_elastic_config_dict)
    for key in ("max_train_batch_size", "micro_batch_sizes", "version"):
        if getattr(scheduler, key) != getattr(runtime, key):
            raise ElasticityConfigError(f"Elastic config '{key}={getattr(scheduler, key)}' seen by resource "
                                        f"scheduler does not match config passed to runtime "
                                        f"{key}={getattr(runtime, key)}", f"elasticity.{key}")


def _world_size_from_env(version: Any, purpose: str) -> int:
    value = os.environ.get("WORLD_SIZE")
    if value is not None and value.isnumeric():
        return int(value)
    raise ElasticityConfigError(f"Elasticity V {version} needs WORLD_SIZE to compute {purpose}. Either give it as "
                                "argument to function compute_elastic_config or set it as an environment variable. "
                                f"Value of WORLD_SIZE as environment variable is {value}")


def _largest_micro(cfg: ElasticityConfig, batch: int, world_size: int, valid: list[int] | None) -> int:
    if world_size not in (valid or []):
        raise ElasticityIncompatibleWorldSize(f"World size ({world_size}) is not valid with the current list of "
                                              f"valid GPU counts: {valid}")
    micro = next((mb for mb in sorted(set(cfg.micro_batch_sizes or []), reverse=True) if batch // world_size % mb == 0),
                 None)
    assert micro is not None, f"no micro batch divides {batch} / {world_size}"  # valid sizes guarantee one
    return micro


def _check_section_version(cfg: ElasticityConfig) -> None:
    if cfg.model_parallel_size > 1 and cfg.version_number != 0.2:
        raise ElasticityConfigError(f"Elasticity V{cfg.version} does not support model-parallel training. Given "
                                    f"model-parallel size: {cfg.model_parallel_size}", "elasticity.model_parallel_size")
    if cfg.version_number > LATEST_ELASTICITY_VERSION:
        raise ElasticityConfigError(f"Attempting to run elasticity version {cfg.version} but runtime only supports "
                                    f"up to {LATEST_ELASTICITY_VERSION}", "elasticity.version")


def elastic_batch(cfg: ElasticityConfig, world_size: int = 0,
                  return_microbatch: bool = False) -> tuple[int, list[int] | None] | tuple[int, list[int] | None, int]:
    """``compute_elastic_config`` on a validated, enabled section."""
    _check_section_version(cfg)
    version = cfg.version_number
    micro_batches = list(cfg.micro_batch_sizes or [])
    max_batch = int(cfg.max_train_batch_size or 0)
    micro_v02: int | None = None
    if version == 0.1:
        batch, valid = _compatible_v01(micro_batches, max_batch, cfg.min_gpus, cfg.max_gpus, cfg.prefer_larger_batch)
    elif version == 0.2:
        gpus = world_size if world_size != 0 else _world_size_from_env(cfg.version, "valid batch size")
        batch, valid, micro_v02 = _compatible_v02(micro_batches, max_batch, gpus, cfg.min_gpus, cfg.max_gpus,
                                                  cfg.prefer_larger_batch, cfg.num_gpus_per_node,
                                                  cfg.model_parallel_size)
    else:
        raise ElasticityConfigError(f"Unable to find elastic logic for version: {cfg.version}", "elasticity.version")
    batch = int(batch)
    _log.info("Valid World Size (GPUs / Model Parallel Size): %s", valid)
    if world_size > 0:
        return batch, valid, _largest_micro(cfg, batch, world_size, valid)
    if return_microbatch:
        if version == 0.2:
            return batch, valid, micro_v02  # type: ignore[return-value]
        size = _world_size_from_env(cfg.version, "a micro batch size")
        return batch, valid, _largest_micro(cfg, batch, size, valid)
    return batch, valid


def compute_elastic_config(ds_config: dict[str, Any], target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False) -> tuple[Any, ...]:
    """DeepSpeed's API: ``(train_batch_size, valid_world_sizes)``, plus the micro batch size when
    ``world_size > 0`` (checked against the valid sizes) or ``return_microbatch`` (world size from the
    ``WORLD_SIZE`` environment variable). Deterministic for a given config: schedulers and every rank agree."""
    if not isinstance(ds_config, dict):
        raise ValueError(f"Expected ds_config to be a dictionary but received a {type(ds_config)}, containing: "
                         f"{ds_config}")
    if "elasticity" not in ds_config:
        raise ElasticityConfigError("'elasticity' is missing from config json, please add it if running an elastic "
                                    "training job.")
    section = ds_config["elasticity"]
    if not (isinstance(section, dict) and section.get("enabled", False)):
        raise ElasticityConfigError("Elasticity is disabled, please enable it ('enabled':true) if running an elastic "
                                    "training job.", "elasticity.enabled")
    cfg = parse_elasticity(section)
    _check_section_version(cfg)
    _check_target_version(target_deepspeed_version)
    return elastic_batch(cfg, world_size, return_microbatch)
