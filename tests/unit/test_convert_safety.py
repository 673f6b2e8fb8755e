"""``convert-deepspeed`` never touches its source, never replaces an existing tag unless told to (and then only
zerospeed's own files), carries DeepSpeed's client state, counters, sampler and scheduler state, and answers
bad input in one line with exit 2 (issue 31, items 1, 2 and 14)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from zerospeed.launcher.cli import main as cli
from zerospeed.runtime.checkpoint import CheckpointError, convert_deepspeed
from zerospeed.runtime.checkpoint import layout
from zerospeed.runtime.checkpoint.deepspeed_read import safe_load
from zerospeed.runtime.checkpoint.state import from_json

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed" / "stage2"


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _ds_copy(tmp_path: Path, tag: str = "global_step3", extra: dict | None = None) -> Path:
    """The stage-2 fixture under DeepSpeed's default tag, with ``extra`` keys saved into its model states."""
    ds = tmp_path / "ds"
    shutil.copytree(FIXTURE / "step3", ds / tag)
    (ds / "latest").write_text(tag)
    if extra:
        path = ds / tag / "mp_rank_00_model_states.pt"
        state = safe_load(str(path))
        state.update(extra)
        torch.save(state, path)
    return ds


def test_output_equal_to_input_leaves_the_source_untouched(tmp_path: Path) -> None:
    ds = _ds_copy(tmp_path)
    before = _digests(ds)
    assert cli(["convert-deepspeed", str(ds), str(ds)]) == 2
    assert cli(["convert-deepspeed", str(ds), str(ds), "--overwrite"]) == 2
    assert _digests(ds) == before


def test_existing_tag_is_refused_and_overwrite_keeps_user_files(tmp_path: Path) -> None:
    ds = _ds_copy(tmp_path)
    out = tmp_path / "out"
    (out / "global_step3").mkdir(parents=True)
    (out / "global_step3" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists"):
        convert_deepspeed(str(ds), str(out))
    assert cli(["convert-deepspeed", str(ds), str(out)]) == 2
    assert sorted(p.name for p in (out / "global_step3").iterdir()) == ["notes.txt"]
    for _ in range(2):  # onto a foreign directory, then onto its own earlier conversion
        assert cli(["convert-deepspeed", str(ds), str(out), "--overwrite"]) == 0
        assert (out / "global_step3" / "notes.txt").read_text() == "mine"
        assert (out / "global_step3" / layout.MANIFEST).is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_commit_overwrite_policy(tmp_path: Path) -> None:
    """``overwrite=True`` replaces an earlier zerospeed checkpoint of the tag, keeping other files in it;
    ``None`` (the engine's default) and ``False`` refuse any existing tag, zerospeed's or not (issue 31)."""
    d = str(tmp_path)
    for i in range(2):
        staging = layout.begin(d, "t")
        layout.publish_marker(staging, 0, {}, {})
        if i == 0:
            layout.commit(d, "t", staging, layout.wait_markers(staging, 1, 5.0), True)
            (tmp_path / "t" / "user.txt").write_text("keep")
        else:
            layout.commit(d, "t", staging, layout.wait_markers(staging, 1, 5.0), True, overwrite=True)
    assert (tmp_path / "t" / "user.txt").read_text() == "keep"
    with pytest.raises(CheckpointError, match=r"tag 't' already exists .*a zerospeed checkpoint.*overwrite=True"):
        layout.check_overwrite(d, "t", None)  # the default: a save never silently replaces a checkpoint
    with pytest.raises(CheckpointError, match="already exists"):
        layout.check_overwrite(d, "t", False)
    (tmp_path / "foreign").mkdir()
    with pytest.raises(CheckpointError, match="not a zerospeed checkpoint"):
        layout.check_overwrite(d, "foreign", None)
    layout.check_overwrite(d, "foreign", True)


def test_client_state_counters_sampler_and_scheduler_come_through(tmp_path: Path) -> None:
    sampler = {"consumed_samples": 12, "curriculum_step": 3, "batch": [1, 2]}
    ds = _ds_copy(tmp_path, extra={"next_step": 5, "note": "x", "ema": torch.ones(3), "data_sampler": sampler,
                                   "skipped_steps": 1})
    out = tmp_path / "out"
    convert_deepspeed(str(ds), str(out))
    meta = layout.read_json(str(out / "global_step3" / layout.META))
    from safetensors.torch import load_file

    tensors = load_file(str(out / "global_step3" / "client_state.safetensors"))
    client = from_json(meta["client_state"], tensors)
    assert client["next_step"] == 5 and client["note"] == "x"
    torch.testing.assert_close(client["ema"], torch.ones(3))
    assert meta["data"] == sampler
    assert meta["engine"]["global_samples"] == 12 and meta["engine"]["skipped_steps"] == 1
    assert meta["lr_scheduler"] == {"last_batch_iteration": 2}
    assert "client_state.safetensors" in layout.read_json(str(out / "global_step3" / layout.MANIFEST))["files"]


@pytest.mark.parametrize("damage", ["binary_latest", "no_param_shapes", "not_a_dict"])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, damage: str, capsys) -> None:
    ds = _ds_copy(tmp_path)
    model = ds / "global_step3" / "mp_rank_00_model_states.pt"
    if damage == "binary_latest":
        (ds / "latest").write_bytes(b"\xff\xfe\x00")
    elif damage == "no_param_shapes":
        state = safe_load(str(model))
        del state["param_shapes"]
        torch.save(state, model)
    else:
        torch.save([1, 2, 3], model)
    assert cli(["convert-deepspeed", str(ds), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
