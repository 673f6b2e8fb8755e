"""Regenerate tests/unit/fixtures/deepspeed_elasticity.json from DeepSpeed 0.19.6's own elasticity code.

DeepSpeed removed ``deepspeed.elasticity`` in 0.19.8; take the 0.19.6 source (needs numpy and packaging):
    pip download deepspeed==0.19.6 --no-deps --no-binary :all: -d /tmp/ds && tar xzf /tmp/ds/deepspeed-0.19.6.tar.gz -C /tmp/ds
    python scripts/deepspeed_elasticity_reference.py /tmp/ds/deepspeed-0.19.6
Its ``elasticity/{constants,config,elasticity}.py`` are loaded as a stand-alone package (two stub modules
for the version string and the logger). Each case stores the inputs and 0.19.6's result (or error class
name). Where DeepSpeed's later fix of version 0.2's micro batch (divide by the data-parallel size, not by
every GPU; its test ``test_model_parallel_v2_microbatch_is_per_dp_rank``) changes the result, the fixed
micro batch is stored too (``fixed_micro``): zerospeed follows the fix.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
import types
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "unit" / "fixtures" / "deepspeed_elasticity.json"
MICROS = [[2, 4, 6], [8, 12, 16, 17], [1, 2, 3, 7], [8, 10, 12], [4, 8], [6, 9, 15]]

# DeepSpeed's later fix (master after 0.19.7): get_microbatch divides by the data-parallel size.
FIX = [("def get_microbatch(final_batch_size):", "def get_microbatch(final_batch_size, dp_world_size):"),
       ("if final_batch_size // current_num_gpus % micro_batch == 0:",
        "if final_batch_size // dp_world_size % micro_batch == 0:"),
       ("candidate_microbatch = get_microbatch(final_batch_size)",
        "candidate_microbatch = get_microbatch(final_batch_size, current_num_gpus // model_parallel_size)"),
       ("candidate_microbatch = get_microbatch(candidate_batch_size)",
        "candidate_microbatch = get_microbatch(candidate_batch_size, int(current_dp_size))")]


def cases() -> list[tuple[dict, int, bool, int | None]]:
    """(elasticity section, world_size, return_microbatch, WORLD_SIZE in the environment)."""
    out = []
    for mbs, mx, (lo, hi), pl in itertools.product(MICROS, [7, 100, 2000, 10000], [(1, 10000), (32, 1500)],
                                                   [True, False]):
        out.append(({"enabled": True, "max_train_batch_size": mx, "micro_batch_sizes": mbs, "min_gpus": lo,
                     "max_gpus": hi, "prefer_larger_batch": pl, "version": 0.1}, 0, False, None))
    for mbs, mx, ws in itertools.product(MICROS[:3], [2000, 10000], [2, 3, 16, 64, 128]):
        el = {"enabled": True, "max_train_batch_size": mx, "micro_batch_sizes": mbs, "version": 0.1}
        out.append((el, ws, False, None))
        if ws in (3, 64):
            out.append((el, 0, True, ws))
    for mbs, mx, (gpn, mp), ws, pl in itertools.product([[2, 4, 6], [4, 8], [1, 2, 3, 7]], [64, 2000],
                                                        [(1, 1), (8, 1), (8, 2), (8, 4)], [16, 24], [True, False]):
        el = {"enabled": True, "max_train_batch_size": mx, "micro_batch_sizes": mbs, "num_gpus_per_node": gpn,
              "model_parallel_size": mp, "version": 0.2, "prefer_larger_batch": pl, "min_gpus": 1, "max_gpus": 256}
        out.append((el, ws, False, None))
        out.append((el, 0, True, ws))
    return out


def _load(src: Path, name: str, fixed: bool):
    """DeepSpeed's elasticity package as ``<name>.elasticity``, importable without the rest of DeepSpeed."""
    root = Path(tempfile.mkdtemp()) / name
    (root / "elasticity").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "git_version_info.py").write_text("version = '0.19.6'\n")
    (root / "utils.py").write_text("import logging\nlogger = logging.getLogger('deepspeed')\n")
    (root / "elasticity" / "__init__.py").write_text("")
    for f in ("constants.py", "config.py", "elasticity.py"):
        text = (src / "deepspeed" / "elasticity" / f).read_text()
        if fixed and f == "elasticity.py":
            for old, new in FIX:
                assert old in text, old
                text = text.replace(old, new)
        (root / "elasticity" / f).write_text(text)
    sys.path.insert(0, str(root.parent))
    return __import__(f"{name}.elasticity.elasticity", fromlist=["compute_elastic_config"])


def _run(mod: types.ModuleType, el: dict, ws: int, rm: bool, env: int | None) -> list:
    os.environ.pop("WORLD_SIZE", None)
    if env is not None:
        os.environ["WORLD_SIZE"] = str(env)
    try:
        r = mod.compute_elastic_config({"elasticity": el}, "0.19.6", world_size=ws, return_microbatch=rm)
    except Exception as exc:  # noqa: BLE001 - the error class is the result
        return ["error", type(exc).__name__]
    valid = None if r[1] is None else [int(x) for x in r[1]]
    return ["ok", int(r[0]), valid] + ([None if r[2] is None else int(r[2])] if len(r) > 2 else [])


def main() -> None:
    src = Path(sys.argv[1])
    ds, fixed = _load(src, "ds0196", False), _load(src, "ds0196fixed", True)
    rows = []
    for el, ws, rm, env in cases():
        got, fix = _run(ds, el, ws, rm, env), _run(fixed, el, ws, rm, env)
        row = {"elasticity": el, "world_size": ws, "return_microbatch": rm, "env_world_size": env, "deepspeed": got}
        if fix != got:
            assert fix[:3] == got[:3], (el, got, fix)  # only the micro batch may change
            row["fixed_micro"] = fix[3]
        rows.append(row)
    body = ",\n".join(json.dumps(r, separators=(",", ":")) for r in rows)  # one case per line
    OUT.write_text(f'{{"deepspeed_version":"0.19.6","cases":[\n{body}\n]}}\n')
    print(f"{len(rows)} cases -> {OUT}")


if __name__ == "__main__":
    main()
