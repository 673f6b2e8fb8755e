"""What the ranks must agree on when they save or load, and failures that must be collective.

tag_validation (Ignore / Warn / Fail), one directory for every rank, no save in the middle of a gradient
accumulation, load_universal (resharding is opt-in, as in DeepSpeed), load_from_fp32_weights, and a write
error on one rank failing the save on every rank (sync and async) with ``latest`` untouched.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import pytest
import torch

from zerospeed.runtime.checkpoint import CheckpointError, verify_checkpoint
from zerospeed.testing import run_distributed

from .ckpt_common import MB, build, full_state, train
from .parity import micro_batch


def _tags(path: str) -> dict[str, Any]:
    from zerospeed import comm

    rank, out = comm.get_rank(), {}
    for mode in ("fail", "Warn", "IGNORE"):  # DeepSpeed compares case-insensitively
        engine = build(1, {"checkpoint": {"tag_validation": mode}})
        train(engine, 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                engine.save_checkpoint(os.path.join(path, mode), tag=f"t{rank}")
                out[mode] = "saved"
            except CheckpointError as exc:
                out[mode] = str(exc)
        out[mode + "_warned"] = any("not the same on every rank" in str(w.message) for w in caught)
    return out


def test_tag_validation_modes(tmp_path: Any) -> None:
    for r in run_distributed(_tags, 2, str(tmp_path), timeout=60):
        assert "tag is not the same on every rank" in r["fail"] and "rank 1: t1" in r["fail"]
        assert r["Warn"] == "saved" and r["Warn_warned"]
        assert r["IGNORE"] == "saved" and not r["IGNORE_warned"]
    assert not os.path.exists(tmp_path / "fail" / "latest")
    for mode in ("Warn", "IGNORE"):  # one consistent checkpoint, under rank 0's tag
        assert os.path.basename(verify_checkpoint(str(tmp_path / mode))) == "t0"
        assert not os.path.exists(tmp_path / mode / "t1")


def _dirs(path: str) -> tuple[str, str]:
    from zerospeed import comm

    rank = comm.get_rank()
    engine = build(1)
    train(engine, 1)
    errors = []
    try:  # a timestamp in the path: each rank gets another directory
        engine.save_checkpoint(os.path.join(path, f"run-{rank}"), tag="a")
        errors.append("")
    except CheckpointError as exc:
        errors.append(str(exc))
    engine.save_checkpoint(os.path.join(path, "shared"), tag="a")  # still in step: the failure was collective
    try:
        engine.load_checkpoint(os.path.join(path, "shared" if rank == 0 else "elsewhere"))
        errors.append("")
    except CheckpointError as exc:
        errors.append(str(exc))
    return errors[0], errors[1]


def test_ranks_with_different_directories_fail_on_save_and_load(tmp_path: Any) -> None:
    for save_err, load_err in run_distributed(_dirs, 2, str(tmp_path), timeout=60):
        assert "ranks passed different checkpoint directories" in save_err and "run-1" in save_err
        assert "found different checkpoints" in load_err and "elsewhere" in load_err
    assert sorted(os.listdir(tmp_path)) == ["run-0", "shared"]
    assert os.listdir(tmp_path / "run-0") == []  # nothing of rank 1 written into rank 0's directory
    verify_checkpoint(str(tmp_path / "shared"))


def _mid_accumulation(path: str) -> tuple[str, int]:
    from zerospeed import comm

    engine = build(1)  # gas 2 at world 2
    x, y = micro_batch(0, 0, comm.get_rank(), comm.get_world_size(), MB, 2)
    engine.backward(engine(x, y))
    engine.step()
    try:
        engine.save_checkpoint(path, tag="mid")
        error = ""
    except CheckpointError as exc:
        error = str(exc)
    x, y = micro_batch(0, 1, comm.get_rank(), comm.get_world_size(), MB, 2)
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(path, tag="boundary")
    return error, engine.global_steps


def test_save_in_the_middle_of_accumulation_refuses(tmp_path: Any) -> None:
    for error, steps in run_distributed(_mid_accumulation, 2, str(tmp_path), timeout=60):
        assert "middle of a gradient accumulation" in error and "gradient_accumulation_steps=2" in error
        assert steps == 1
    assert os.path.basename(verify_checkpoint(str(tmp_path))) == "boundary"


def _save_bf16(path: str) -> dict[str, torch.Tensor]:
    engine = build(2, {"bf16": {"enabled": True}})
    train(engine, 3)
    engine.save_checkpoint(path, tag="t")
    return full_state(engine, fp32=True)


def _load_into(path: str, extra: dict[str, Any]) -> Any:
    engine = build(1, extra)
    try:
        engine.load_checkpoint(path)
    except CheckpointError as exc:
        return str(exc)
    return full_state(engine, fp32=True)


def test_load_universal_and_load_from_fp32_weights(tmp_path: Any) -> None:
    path = str(tmp_path)
    saved = run_distributed(_save_bf16, 2, path, timeout=60)[0]
    bf16 = {"bf16": {"enabled": True}}
    # Another world size reshards the optimizer state: refused by default (DeepSpeed's rule), allowed with the key.
    refused = run_distributed(_load_into, 1, path, bf16, timeout=60)[0]
    assert isinstance(refused, str) and "load_universal" in refused and "over 2 data-parallel ranks" in refused
    resharded = run_distributed(_load_into, 1, path, {**bf16, "checkpoint": {"load_universal": True}}, timeout=60)[0]
    # Same world size, stage 2 -> 1 (same partitioning): no key needed; the master is the saved fp32 master.
    same = run_distributed(_load_into, 2, path, bf16, timeout=60)[0]
    zero16 = {**bf16, "zero_optimization": {"stage": 1, "load_from_fp32_weights": False}}
    from16 = run_distributed(_load_into, 2, path, zero16, timeout=60)[0]
    rounded = {k: v.to(torch.bfloat16).float() for k, v in saved.items()}
    assert any(not torch.equal(saved[k], rounded[k]) for k in saved)  # the test can tell the two apart
    for k in saved:
        assert torch.equal(resharded[k], saved[k]) and torch.equal(same[k], saved[k]), k
        assert torch.equal(from16[k], rounded[k]), k


def _inject(path: str, async_save: bool) -> tuple[str, float]:
    from zerospeed import comm
    from zerospeed.runtime.checkpoint import save as save_mod

    engine = build(1)
    train(engine, 1)
    engine.save_checkpoint(path, tag="good")
    train(engine, 1)
    real = save_mod.write_tensors

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("No space left on device (injected)")

    if comm.get_rank() == 1:
        save_mod.write_tensors = broken
    start, error = time.monotonic(), ""
    try:
        engine.save_checkpoint(path, tag="bad", async_save=async_save)
        engine.wait_for_checkpoint()
    except (CheckpointError, RuntimeError) as exc:
        error = str(exc)
    elapsed = time.monotonic() - start
    save_mod.write_tensors = real
    train(engine, 1)  # collectives still in step on every rank
    engine.save_checkpoint(os.path.join(path, "after"), tag="ok", async_save=async_save)
    engine.wait_for_checkpoint()
    return error, elapsed


@pytest.mark.parametrize("async_save", [False, True])
def test_write_error_on_one_rank_fails_the_save_on_all(async_save: bool, tmp_path: Any) -> None:
    path = str(tmp_path)
    for error, elapsed in run_distributed(_inject, 2, path, async_save, timeout=90):
        assert "rank 1" in error and "injected" in error, error
        assert elapsed < 15.0
    assert os.path.basename(verify_checkpoint(path)) == "good"  # `latest` still names the previous checkpoint
    assert not os.path.exists(os.path.join(path, "bad"))
    verify_checkpoint(os.path.join(path, "after"))
