"""Hostile checkpoints (issue 31, items 4, 5 and 14): every tampered or malformed checkpoint fails the load
with the same ``CheckpointError`` on every rank, naming the file and field, and leaves the engine exactly as
it was (stage, agree, apply: ``runtime/checkpoint/staged.py``); the manifest binds every file the loader opens."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, Callable

import pytest
import torch

from zerospeed.runtime.checkpoint import CheckpointError
from zerospeed.testing import run_distributed

from .ckpt_common import build, full_state, train


def _save(stage: int, path: str) -> None:
    engine = build(stage)
    train(engine, 2)
    engine.save_checkpoint(path, tag="t")
    engine.save_checkpoint(path, tag="other")


def _rewrite(ckpt: str, rel: str, data: bytes) -> None:
    """Replace a file and re-bind it in the manifest (as a careful attacker would)."""
    with open(os.path.join(ckpt, rel), "wb") as f:
        f.write(data)
    man = json.load(open(os.path.join(ckpt, "manifest.json")))
    man["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    json.dump(man, open(os.path.join(ckpt, "manifest.json"), "w"))


def _edit_json(ckpt: str, rel: str, fn: Callable[[Any], Any], rebind: bool = True) -> None:
    obj = fn(json.load(open(os.path.join(ckpt, rel))))
    data = json.dumps(obj).encode()
    if rebind:
        _rewrite(ckpt, rel, data)
    else:
        open(os.path.join(ckpt, rel), "wb").write(data)


def _manifest(ckpt: str, fn: Callable[[dict], Any]) -> None:
    path = os.path.join(ckpt, "manifest.json")
    man = json.load(open(path))
    out = fn(man)
    json.dump(out if isinstance(out, dict) and "format" in out else man, open(path, "w"))  # a new one, or edited


def _shrink_rank1_piece(index: dict) -> dict:
    key = next(k for k, v in index.items() if k.startswith("master/") and len(v) == 2)
    index[key][1][2] -= 1  # rank 1's piece ends one element early: rank 1's owned range is not covered
    return index


def _meta_unlisted(c: str) -> None:
    _manifest(c, lambda m: m["files"].pop("meta.json"))
    _edit_json(c, "meta.json", lambda m: {**m, "engine": {**m["engine"], "global_steps": 999}}, rebind=False)


def _rng_gone(c: str) -> None:
    _manifest(c, lambda m: m["files"].pop("rng/rank_00001.json"))
    os.remove(os.path.join(c, "rng", "rank_00001.json"))


def _other_tag_shard(c: str) -> None:
    shutil.copy(os.path.join(c, "..", "other", "shards", "rank_00001.safetensors"), os.path.join(c, "foreign.safetensors"))
    _edit_json(c, "index.json", lambda ix: {k: [["foreign.safetensors" if p[0].endswith("rank_00001.safetensors")
                                                  else p[0], p[1], p[2]] for p in v] for k, v in ix.items()})


# case name -> (tampering, a regex the message must match)
CASES: dict[str, tuple[Callable[[str], None], str]] = {
    "bad_rng_rank1": (lambda c: _rewrite(c, "rng/rank_00001.json", b'{"torch_cpu": "AAAA", "python": [3, [], null]}'),
                      r"rank 1: .*rank_00001\.json: field 'torch_cpu'"),
    "index_gap_rank1": (lambda c: _edit_json(c, "index.json", _shrink_rank1_piece), r"not all present"),
    "wrong_shape": (lambda c: _edit_json(c, "meta.json", lambda m: {**m, "tensors": {
        k: ({**v, "shape": [v["shape"][0] + 1, *v["shape"][1:]]} if k == "unused" else v)
        for k, v in m["tensors"].items()}}), r"has shape \[4\], the model has \[3\]"),
    "meta_unlisted": (_meta_unlisted, r"manifest\.json: field 'files' does not list 'meta\.json'"),
    "rng_unlisted_and_missing": (_rng_gone, r"rank 1: .*does not list 'rng/rank_00001\.json'"),
    "dotdot_entry": (lambda c: _manifest(c, lambda m: m["files"].update(
        {"../../outside": {"bytes": 1, "sha256": "0" * 64}})), r"'\.\./\.\./outside' is not a normalised relative"),
    "absolute_entry": (lambda c: _manifest(c, lambda m: m["files"].update(
        {"/etc/hostname": {"bytes": 1, "sha256": "0" * 64}})), r"'/etc/hostname' is not a normalised relative"),
    "index_other_tag": (_other_tag_shard, r"points at 'foreign\.safetensors', which the manifest does not list"),
    "files_list": (lambda c: _manifest(c, lambda m: {**m, "files": list(m["files"])}),
                   r"manifest\.json: field 'files' is a list"),
    "no_sha256": (lambda c: _manifest(c, lambda m: m["files"]["meta.json"].pop("sha256")),
                  r"field 'files\.meta\.json\.sha256' is None"),
    "version_abc": (lambda c: _manifest(c, lambda m: m.update(version="abc")), r"field 'version' is 'abc'"),
    "counters_text": (lambda c: _edit_json(c, "meta.json", lambda m: {**m, "engine": {**m["engine"],
                                                                                      "global_steps": "x"}}),
                      r"field 'engine\.global_steps' is 'x'"),
}
POINTER_CASES = {"binary_latest": r"latest is not a text file", "directory_latest": r"latest is not a file"}


def _try_loads(stage: int, root: str, names: list[str]) -> dict[str, str]:
    engine = build(stage)
    train(engine, 1)
    before, steps = full_state(engine, fp32=True), engine.global_steps
    opt_before = {id(p): {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                  for p, s in engine.optimizer.optimizer.state.items()}
    out = {}
    for name in names:
        try:
            engine.load_checkpoint(os.path.join(root, name), tag=None if name in POINTER_CASES else "t")
            out[name] = "loaded"
        except CheckpointError as exc:
            out[name] = str(exc)
        after = full_state(engine, fp32=True)
        assert engine.global_steps == steps, name
        for k, v in before.items():
            torch.testing.assert_close(after[k], v, rtol=0, atol=0, msg=f"{name}: {k} changed")
        for p, s in engine.optimizer.optimizer.state.items():
            for k, v in opt_before.get(id(p), {}).items():
                torch.testing.assert_close(s[k], v, rtol=0, atol=0, msg=f"{name}: optimizer {k} changed")
    loaded, _ = engine.load_checkpoint(os.path.join(root, "pristine"), tag="t")  # still usable, and loads
    out["pristine"] = "loaded" if loaded else "none"
    train(engine, 1)
    return out


@pytest.mark.parametrize("stage", [3])  # the stage whose load has collectives (stage 2 runs the same checks)
def test_tampered_checkpoints_fail_alike_on_every_rank_and_change_nothing(stage: int, tmp_path: Any) -> None:
    src = str(tmp_path / "src")
    run_distributed(_save, 2, stage, src, timeout=60)
    for name in [*CASES, *POINTER_CASES, "pristine"]:
        shutil.copytree(src, str(tmp_path / name))
        if name in CASES:
            CASES[name][0](str(tmp_path / name / "t"))
    (tmp_path / "binary_latest" / "latest").write_bytes(b"\xff\xfe\x00t")
    os.remove(tmp_path / "directory_latest" / "latest")
    (tmp_path / "directory_latest" / "latest").mkdir()
    got = run_distributed(_try_loads, 2, stage, str(tmp_path), [*CASES, *POINTER_CASES], timeout=120)
    assert got[0] == got[1], "the ranks disagree on the outcome"
    expected = {**{k: v for k, (_, v) in CASES.items()}, **POINTER_CASES}
    for name, pattern in expected.items():
        assert got[0][name] != "loaded", name
        import re

        assert re.search(pattern, got[0][name]), f"{name}: {got[0][name]}"
    assert got[0]["pristine"] == "loaded"
