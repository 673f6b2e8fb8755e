"""Checkpoint layout without processes: tensor files round-trip, the commit protocol, tag checks, recovery."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from zerospeed.runtime.checkpoint import layout
from zerospeed.runtime.checkpoint.errors import CheckpointError
from zerospeed.runtime.checkpoint.state import from_json, to_json
from zerospeed.runtime.checkpoint.tensor_file import TensorReader, write_tensors


def test_tensor_file_round_trip_and_is_real_safetensors(tmp_path: Any) -> None:
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.tensor(4.0),
               "d": torch.arange(5), "e": torch.zeros(0)}
    path = str(tmp_path / "x.safetensors")
    size, _ = write_tensors(path, tensors, {"format": "pt"})
    assert size == os.path.getsize(path)
    ref = load_file(path)
    with TensorReader(path) as r:
        for k, t in tensors.items():
            assert torch.equal(r.read(k), t) and torch.equal(ref[k], t)
        assert torch.equal(r.read_range("a", 4, 9), tensors["a"].reshape(-1)[4:9])


def _commit(save_dir: str, tag: str, value: float, overwrite: bool | None = None) -> str:
    staging = layout.begin(save_dir, tag)
    size, digest = write_tensors(os.path.join(staging, layout.shard_file(0)), {"master/w": torch.full((4,), value)})
    layout.publish_marker(staging, 0, {layout.shard_file(0): {"bytes": size, "sha256": digest}}, {"master/w": [0, 4]})
    return layout.commit(save_dir, tag, staging, layout.wait_markers(staging, 1, 5), save_latest=True,
                         overwrite=overwrite)


def test_commit_overwrite_and_recovery_between_renames(tmp_path: Any) -> None:
    d = str(tmp_path)
    _commit(d, "t", 1.0)
    final = _commit(d, "t", 2.0, overwrite=True)
    assert layout.resolve(d, None) == final
    layout.verify_files(final, layout.read_manifest(final))
    # A crash between "rename old aside" and "rename new into place": the old copy is still found.
    os.rename(final, os.path.join(d, ".old-t-deadbeef"))
    assert layout.resolve(d, None).endswith(".old-t-deadbeef")
    # A half-written staging directory never becomes latest and the next save removes it.
    staging = layout.begin(d, "u")
    assert open(os.path.join(d, layout.LATEST)).read() == "t"
    _commit(d, "v", 3.0)
    assert not os.path.exists(staging)


def test_missing_rank_marker_is_not_committed(tmp_path: Any) -> None:
    staging = layout.begin(str(tmp_path), "t")
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[0\] did not finish"):
        layout.wait_markers(staging, 1, 0.05)


@pytest.mark.parametrize("tag", ["", "../x", ".hidden", "a/b", "latest"])
def test_bad_tags(tag: str) -> None:
    with pytest.raises(ValueError, match="plain name"):
        layout.check_tag(tag)


def test_client_state_json_refuses_objects() -> None:
    tensors: dict[str, torch.Tensor] = {}
    packed = to_json({"a": 1.5, "b": [1, (2, 3)], "t": torch.ones(2)}, "client_state", tensors)
    assert from_json(packed, tensors)["b"] == [1, [2, 3]]
    with pytest.raises(ValueError, match=r"client_state\.f: a function cannot be stored"):
        to_json({"f": lambda: 0}, "client_state", tensors)


def test_relay_checks_ranges_from_the_index_without_reading() -> None:
    """pipeline_loading_checkpoint stages by index only: a missing key or uncovered range fails as a read would."""
    from zerospeed.runtime.checkpoint.errors import CheckpointError
    from zerospeed.runtime.checkpoint.staged import StagedReader
    from zerospeed.runtime.checkpoint.universal import CheckpointReader

    reader = StagedReader(CheckpointReader("/nonexistent", {"master/w": [["a.safetensors", 0, 4],
                                                                         ["b.safetensors", 6, 10]]}), "/nonexistent")
    reader.check("master/w", 0, 4)  # no file is opened
    reader.check("master/w", 6, 8)
    with pytest.raises(CheckpointError, match=r"elements 2\.\.8 of 'master/w' are not all present"):
        reader.check("master/w", 2, 8)
    with pytest.raises(CheckpointError, match="has no tensor 'master/v'"):
        reader.check("master/v", 0, 1)
    with pytest.raises(CheckpointError, match="has no tensor 'scalar/step/w'"):
        reader.check_scalar("scalar/step/w")
