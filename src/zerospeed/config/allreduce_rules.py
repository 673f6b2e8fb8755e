"""``gradient_allreduce_op: "sum"`` refused where DeepSpeed 0.19.8 refuses it, when the config is read.

DeepSpeed checks the op against the raw config before any section's own checks, so its words are what a
user sees first: "sum" is not supported with ZeRO stage 3, with a ZenFlow section, or with DeepCompile
(each of those reduces through its own path, which averages). zerospeed's stage-3 reducer could sum, but no
parity test covers it, so the refusal is kept as DeepSpeed's. (1-bit optimizers and ZeRO++ qgZ, which also
average by themselves, are refused at ``initialize()``: runtime/plan.py.)
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError


def refuse_sum_combinations(raw: Any) -> None:
    """Raise ``ConfigError`` (a ``ValueError``; DeepSpeed's words) for "sum" with stage 3, ZenFlow or DeepCompile in ``raw``."""
    if not isinstance(raw, dict):
        return
    op = raw.get("gradient_allreduce_op")
    if not (isinstance(op, str) and op.lower() == "sum"):
        return
    zero = raw.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    compile_ = raw.get("compile")
    why = None
    if zero.get("stage") == 3:
        why = "ZeRO stage 3"
    elif zero.get("zenflow") not in (None, False):
        why = "ZenFlow"
    elif isinstance(compile_, dict) and compile_.get("deepcompile") is True:
        why = "DeepCompile"
    if why is not None:
        raise ConfigError("gradient_allreduce_op", f"\"sum\" is not supported with {why} (as in DeepSpeed 0.19.8; "
                         "use \"mean\", or scale the loss by the data-parallel world size)")
