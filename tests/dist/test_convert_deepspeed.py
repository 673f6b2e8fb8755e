"""Checkpoints written by DeepSpeed 0.19.8 (ZeRO 2 and 3, 2 ranks; tests/fixtures/deepspeed, made by
scripts/deepspeed_checkpoint_fixture.py) convert and resume under zerospeed at world 2 and world 1,
continuing DeepSpeed's own loss curve; a checkpoint holding a malicious pickle is refused without running it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import zerospeed
from zerospeed.launcher.cli import main as cli
from zerospeed.runtime.checkpoint import CheckpointError, convert_deepspeed
from zerospeed.testing import run_distributed

from .ds_ckpt_common import batches, config, micro_gpt

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"
LOSSES = json.loads((FIXTURES / "losses.json").read_text())


def _resume(path: str, stage: int, world: int) -> list[float]:
    cfg = config(stage)
    if world == 1:
        cfg["train_micro_batch_size_per_gpu"] *= 2  # the same global batch: both DeepSpeed ranks' samples
        cfg["checkpoint"] = {"load_universal": True}
    model = micro_gpt()
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    loaded, _ = engine.load_checkpoint(path)
    assert loaded is not None and engine.global_steps == 3
    rank = zerospeed.comm.get_rank()
    losses = []
    for step in range(3, 6):
        pair = batches(step)
        x, y = pair[rank] if world == 2 else (torch.cat([pair[0][0], pair[1][0]]), torch.cat([pair[0][1], pair[1][1]]))
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


@pytest.fixture(scope="module", params=[1, 2, 3])
def converted(request, tmp_path_factory) -> tuple[int, str]:
    stage = request.param
    out = tmp_path_factory.mktemp(f"converted{stage}")
    assert cli(["convert-deepspeed", str(FIXTURES / f"stage{stage}"), str(out)]) == 0
    return stage, str(out)


def test_resume_at_deepspeeds_world_size_continues_its_losses(converted) -> None:
    stage, path = converted
    got = run_distributed(_resume, 2, path, stage, 2)
    want = LOSSES[f"stage{stage}"]["losses"]
    for rank in range(2):
        assert got[rank] == pytest.approx(want[rank], rel=1e-5), f"rank {rank}"


def test_resume_at_world_one(converted) -> None:
    stage, path = converted
    (got,) = run_distributed(_resume, 1, path, stage, 1)
    want = LOSSES[f"stage{stage}"]["losses"]
    assert got == pytest.approx([(a + b) / 2 for a, b in zip(*want)], rel=1e-5)


def test_converted_weights_equal_deepspeeds_module_state(tmp_path) -> None:
    """Stage 2 keeps whole fp32 weights in its model file too: the converted masters must equal them."""
    from zerospeed.runtime.checkpoint.deepspeed_read import safe_load

    out = convert_deepspeed(str(FIXTURES / "stage2"), str(tmp_path))
    zerospeed.runtime.checkpoint.consolidate(str(tmp_path), str(tmp_path / "full.safetensors"))
    from safetensors.torch import load_file

    full = load_file(str(tmp_path / "full.safetensors"))
    module = safe_load(str(FIXTURES / "stage2" / "step3" / "mp_rank_00_model_states.pt"))["module"]
    assert set(full) == set(module) and out["stage"] == 2 and out["world_size"] == 2
    for k, v in module.items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=0, msg=k)


class _Evil:
    def __reduce__(self):  # what a malicious checkpoint does: run a command when unpickled
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_without_running(tmp_path) -> None:
    bad = tmp_path / "ds"
    shutil.copytree(FIXTURES / "stage2", bad)
    marker = tmp_path / "pwned"
    evil = _Evil()
    evil.marker = str(marker)
    target = bad / "step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": evil}, target)
    with pytest.raises(CheckpointError, match="refusing to load .*needs '(posix|os).system'"):
        convert_deepspeed(str(bad), str(tmp_path / "out"))
    assert not marker.exists()
    assert cli(["convert-deepspeed", str(bad), str(tmp_path / "out2")]) == 2
    assert not marker.exists() and not (tmp_path / "out2" / "latest").exists()


def test_missing_rank_file_and_wrong_dir(tmp_path) -> None:
    bad = tmp_path / "ds"
    shutil.copytree(FIXTURES / "stage3", bad)
    (bad / "step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="not 0..N-1"):
        convert_deepspeed(str(bad), str(tmp_path / "out"))
    with pytest.raises(CheckpointError, match="no 'latest'"):
        convert_deepspeed(str(tmp_path), str(tmp_path / "out"))
