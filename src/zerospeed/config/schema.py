"""Every key of the schema, with its status: implemented, accepted hint (reason), or not supported yet.

``python -m zerospeed.config.schema --write docs/config.md`` regenerates the key table of the docs
(between the ``keys:begin`` / ``keys:end`` markers); a unit test fails when the docs are stale, and
``tests/unit/test_config_schema.py`` fails when a key is neither read by code nor listed as a hint.
"""

from __future__ import annotations

import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .hints import ACCEPTED_HINTS
from .unsupported import ACCEPTED_VALUES, NOT_SUPPORTED_YET

BEGIN, END = "<!-- keys:begin (generated: python -m zerospeed.config.schema --write docs/config.md) -->", \
    "<!-- keys:end -->"

# Other spellings DeepSpeed accepts, and what they are read as.
ALIASES: dict[str, str] = {
    "bfloat16": "`bf16`",
    "zero_optimization.cpu_offload": "`offload_optimizer: {device: cpu}` when true (deprecated in DeepSpeed; "
                                     "an error together with `offload_optimizer`)",
    "zero_optimization.cpu_offload_param": "`offload_param: {device: cpu}` when true (deprecated in DeepSpeed; "
                                           "an error together with `offload_param`)",
    "zero_optimization.cpu_offload_use_pin_memory": "nothing: deprecated with no effect in DeepSpeed too (logged)",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "`stage3_gather_16bit_weights_on_model_save`",
    "aio.thread_count": "`aio.intra_op_parallelism`",
}


@dataclass(frozen=True)
class Leaf:
    key: str  # dotted path, e.g. "zero_optimization.offload_optimizer.device"
    model: type[BaseModel]  # the section class declaring the field
    field: str
    parent_attr: str | None  # the attribute holding the section in its parent (None at the root)
    default: Any


def _section_type(annotation: Any) -> type[BaseModel] | None:
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def leaves(model: type[BaseModel], prefix: str = "", parent_attr: str | None = None) -> list[Leaf]:
    """The leaf fields of ``model`` and its nested sections, depth first."""
    out: list[Leaf] = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{info.alias or name}"
        sub = _section_type(info.annotation)
        if sub is not None:
            out += leaves(sub, key + ".", name)
        else:
            default = None if info.default_factory is not None or info.is_required() else info.default
            out.append(Leaf(key, model, name, parent_attr, default))
    return out


def all_leaves() -> list[Leaf]:
    """The whole config: the root model, plus the typed ``optimizer.params`` / ``scheduler.params`` models."""
    from ..optim import factory as opt
    from ..optim.schedules import factory as sched
    from .root import ZeroSpeedConfig

    out = leaves(ZeroSpeedConfig)
    out = [leaf for leaf in out if leaf.key not in ("optimizer.params", "scheduler.params")]
    for name in ("AdamParams", "LambParams", "OneBitAdamParams", "ZeroOneAdamParams",
                 "OneBitLambParams", "MuonParams"):
        out += leaves(getattr(opt, name), "optimizer.params.", "params")
    for name in sorted(n for n in vars(sched) if n.endswith("Params")):
        model = getattr(sched, name)
        if isinstance(model, type) and issubclass(model, BaseModel):
            out += leaves(model, "scheduler.params.", "params")
    return out


def status(key: str) -> str:
    if key in ACCEPTED_HINTS:
        return f"accepted hint ({ACCEPTED_HINTS[key]})"
    if key in NOT_SUPPORTED_YET:
        return f"not supported yet: {NOT_SUPPORTED_YET[key]} ({_off_text(key)})"
    return "implemented"


def _off_text(key: str) -> str:
    if key in ACCEPTED_VALUES:
        values = ", ".join(_json(v) for v in ACCEPTED_VALUES[key])
        return f"accepted only as {values}"
    return "accepted when off"


def _json(value: Any) -> str:
    import json

    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def markdown_table() -> str:
    """One row per key: every schema leaf, every not-supported key, every alias."""
    rows: dict[str, tuple[str, str, str]] = {}
    for leaf in all_leaves():
        where = ""
        if leaf.key.startswith(("optimizer.params.", "scheduler.params.")):
            where = f" ({leaf.model.__name__.removesuffix('Params')})"
        rows[leaf.key + where] = (leaf.key, _json(leaf.default), status(leaf.key))
    for key in NOT_SUPPORTED_YET:
        rows.setdefault(key, (key, "", status(key)))
    for key, meaning in ALIASES.items():
        rows.setdefault(key, (key, "", f"alias: read as {meaning}"))
    lines = [BEGIN, "", "| key | default | status |", "|---|---|---|"]
    for label, (_, default, text) in sorted(rows.items()):
        cell = default.replace("|", "\\|")
        lines.append(f"| `{label}` | {cell} | {text.replace('|', chr(92) + '|')} |")
    lines += ["", END]
    return "\n".join(lines)


def write_docs(path: str | Path) -> bool:
    """Replace the generated table in ``path``; True when it changed."""
    p = Path(path)
    text = p.read_text()
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + markdown_table() + text[stop:]
    if new != text:
        p.write_text(new)
    return new != text


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        print("updated" if write_docs(sys.argv[2]) else "up to date")
    else:
        print(markdown_table())
