"""DeepSpeed's batch-size rule: train_batch_size = micro_batch * gradient_accumulation * dp_world_size.

Any two determine the third; one alone is completed with GAS = 1; an inconsistent triple is an error
that shows the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int


def _positive(name: str, v: int | None) -> None:
    if v is not None and v <= 0:
        raise ConfigError(name, f"must be a positive integer, got {v}")


def resolve_batch(tbs: int | None, micro: int | None, gas: int | None, dp: int) -> BatchSizes:
    for name, v in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", micro),
                    ("gradient_accumulation_steps", gas)):
        _positive(name, v)
    if dp <= 0:
        raise ConfigError("", f"data-parallel world size must be positive, got {dp}")
    if tbs is not None and micro is not None and gas is not None:
        if tbs != micro * gas * dp:
            raise ConfigError(
                "train_batch_size",
                f"{tbs} != train_micro_batch_size_per_gpu ({micro}) * gradient_accumulation_steps ({gas}) "
                f"* data-parallel world size ({dp}) = {micro * gas * dp}. Set two of the three and let "
                "zerospeed derive the third.",
            )
        return BatchSizes(tbs, micro, gas)
    if tbs is not None and micro is not None:
        if tbs % (micro * dp):
            raise ConfigError(
                "train_batch_size",
                f"{tbs} is not divisible by train_micro_batch_size_per_gpu ({micro}) * world size ({dp}) "
                f"= {micro * dp}, so gradient_accumulation_steps cannot be derived.",
            )
        return BatchSizes(tbs, micro, tbs // (micro * dp))
    if tbs is not None and gas is not None:
        if tbs % (gas * dp):
            raise ConfigError(
                "train_batch_size",
                f"{tbs} is not divisible by gradient_accumulation_steps ({gas}) * world size ({dp}) "
                f"= {gas * dp}, so train_micro_batch_size_per_gpu cannot be derived.",
            )
        return BatchSizes(tbs, tbs // (gas * dp), gas)
    if micro is not None and gas is not None:
        return BatchSizes(micro * gas * dp, micro, gas)
    if tbs is not None:
        if tbs % dp:
            raise ConfigError("train_batch_size", f"{tbs} is not divisible by the world size ({dp}).")
        return BatchSizes(tbs, tbs // dp, 1)
    if micro is not None:
        return BatchSizes(micro * dp, micro, 1)
    raise ConfigError(
        "train_batch_size",
        "set at least one of train_batch_size or train_micro_batch_size_per_gpu.",
    )
