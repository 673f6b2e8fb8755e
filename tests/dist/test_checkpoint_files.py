"""Checkpoint files: corruption is named, pickles are refused, to-fp32 is exact, async save commits, data resumes."""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from zerospeed.launcher.cli import main as cli_main
from zerospeed.runtime.checkpoint import CheckpointError, consolidate, verify_checkpoint
from zerospeed.testing import DistributedTestError, run_distributed

from .ckpt_common import build, full_state, train
from .parity import make_model


def _save(stage: int, path: str, extra: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    engine = build(stage, extra)
    train(engine, 2)
    engine.save_checkpoint(path, tag="t")
    return full_state(engine, fp32=True)


def _load(stage: int, path: str) -> str:
    engine = build(stage, {"checkpoint": {"load_universal": True}})
    loaded, _ = engine.load_checkpoint(path)
    return str(loaded)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: Any) -> tuple[str, dict[str, torch.Tensor]]:
    path = str(tmp_path_factory.mktemp("ckpt"))
    state = run_distributed(_save, 2, 2, path, timeout=60)[0]
    return path, state


def _copy(src: str, dst: str) -> str:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_flipped_byte_names_the_file(saved: Any, tmp_path: Any) -> None:
    path = _copy(saved[0], str(tmp_path / "c"))
    victim = os.path.join(path, "t", "shards", "rank_00001.safetensors")
    data = bytearray(open(victim, "rb").read())
    data[-3] ^= 0x40
    open(victim, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="rank_00001.safetensors.*sha256"):
        verify_checkpoint(path)
    with pytest.raises(DistributedTestError, match="rank_00001.safetensors"):
        run_distributed(_load, 2, 1, path, timeout=60)


def test_truncated_file_names_the_file(saved: Any, tmp_path: Any) -> None:
    path = _copy(saved[0], str(tmp_path / "c"))
    victim = os.path.join(path, "t", "model_states.safetensors")
    os.truncate(victim, os.path.getsize(victim) - 5)
    with pytest.raises(CheckpointError, match="model_states.safetensors.*truncated"):
        verify_checkpoint(path)


class _Payload:
    def __reduce__(self) -> Any:
        return (os.system, (f"touch {os.environ['ZS_PAYLOAD_MARK']}",))


def test_pickle_payload_is_refused_and_never_runs(saved: Any, tmp_path: Any, monkeypatch: Any) -> None:
    path = _copy(saved[0], str(tmp_path / "c"))
    mark = str(tmp_path / "payload_ran")
    monkeypatch.setenv("ZS_PAYLOAD_MARK", mark)
    victim = os.path.join(path, "t", "shards", "rank_00000.safetensors")
    blob = pickle.dumps({"w": _Payload()})
    open(victim, "wb").write(blob)
    # Even with the manifest forged to match, the file is parsed as safetensors, never unpickled.
    manifest_path = os.path.join(path, "t", "manifest.json")
    manifest = json.load(open(manifest_path))
    import hashlib

    manifest["files"]["shards/rank_00000.safetensors"] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    json.dump(manifest, open(manifest_path, "w"))
    with pytest.raises(DistributedTestError, match="rank_00000.safetensors is not a valid safetensors file"):
        run_distributed(_load, 1, 0, path, timeout=60)
    assert not os.path.exists(mark)


def test_to_fp32_equals_live_weights(saved: Any, tmp_path: Any) -> None:
    path, state = saved
    out = str(tmp_path / "model.safetensors")
    assert cli_main(["to-fp32", path, out]) == 0
    weights = load_file(out)
    assert weights.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(weights[k], v), k
    model = make_model(seed=123)
    model.load_state_dict(weights)  # plain PyTorch loads it, strict


def _bf16_save(path: str) -> dict[str, torch.Tensor]:
    engine = build(1, {"bf16": {"enabled": True}})
    train(engine, 2)
    engine.save_checkpoint(path)
    return full_state(engine)


def test_to_fp32_bf16_output_equals_live_bf16_model(tmp_path: Any) -> None:
    live = run_distributed(_bf16_save, 2, str(tmp_path), timeout=60)[0]
    info = consolidate(str(tmp_path), str(tmp_path), dtype="bf16")
    weights = load_file(info["path"])
    for k, v in live.items():
        assert weights[k].dtype == v.dtype and torch.equal(weights[k], v), k


def _async(path: str) -> tuple[float, list[float], list[float]]:
    engine = build(2)
    train(engine, 2)
    engine.save_checkpoint(path, tag="a", async_save=True)
    stall = engine.last_checkpoint_stats.stall_s
    losses = train(engine, 2)  # training goes on while the files are written
    engine.wait_for_checkpoint()
    other = build(2)
    other.load_checkpoint(path, tag="a")
    return stall, losses, train(other, 2)


def test_async_save_commits_and_resumes(tmp_path: Any) -> None:
    for stall, losses, resumed in run_distributed(_async, 2, str(tmp_path), timeout=60):
        assert stall >= 0.0 and losses == resumed
    assert open(tmp_path / "latest").read() == "a"
    verify_checkpoint(str(tmp_path))


def _data(path: str, load: bool) -> list[list[int]]:
    import zerospeed
    from zerospeed import comm

    ds = torch.utils.data.TensorDataset(torch.arange(64))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4 // comm.get_world_size(),
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    model = make_model()
    engine, _, loader, _ = zerospeed.initialize(model=model, training_data=ds, config=cfg)
    if load:
        engine.load_checkpoint(path)
        return [b[0].tolist() for b in loader]
    it = iter(loader)
    seen = [next(it)[0].tolist() for _ in range(3)]
    engine.save_checkpoint(path)
    return seen + [b[0].tolist() for b in it]


def test_dataloader_position_resumes_at_another_world_size(tmp_path: Any) -> None:
    full = run_distributed(_data, 2, str(tmp_path), False, timeout=60)
    consumed = {i for r in full for b in r[:3] for i in b}
    rest = run_distributed(_data, 1, str(tmp_path), True, timeout=60)[0]
    resumed = {i for b in rest for i in b}
    assert len(consumed) == 12 and not consumed & resumed and consumed | resumed == set(range(64))
