"""NVMe offload faults: a bad ``nvme_path`` fails before training; a read or write failing during training
raises naming the swap file on its rank (and on every other rank), leaves the model weights unchanged, and
refuses further steps. Offloaded state is saved and loaded by checkpoints like any other state."""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .parity import make_model, micro_batch, param_groups

MB, GAS = 2, 2


def _engine(stage: int, offload: dict[str, Any]) -> Any:
    import zerospeed

    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "sub_group_size": 64,
                              "offload_optimizer": offload},
        "steps_per_print": 1000,
    }
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def _train(engine: Any, first: int, steps: int) -> list[float]:
    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    losses = []
    for step in range(first, first + steps):
        for m in range(GAS):
            x, y = micro_batch(step, m, rank, world, MB, GAS)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        losses.append(float(loss))
    return losses


def _nvme(path: str) -> dict[str, Any]:
    return {"device": "nvme", "nvme_path": path, "buffer_count": 3}


# --- before training -----------------------------------------------------------------------------------
def _init_error(path: str, fake_free: int | None) -> str:
    from zerospeed.offload import preflight

    if fake_free is not None:
        preflight.free_bytes = lambda p: fake_free  # type: ignore[assignment]
    try:
        _engine(2, _nvme(path))
    except ValueError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("case", ["missing", "read_only", "too_small"])
def test_bad_nvme_path_fails_before_training(case: str, tmp_path) -> None:
    path = {"missing": str(tmp_path / "nope"), "read_only": "/sys", "too_small": str(tmp_path)}[case]
    if case == "read_only" and os.access("/sys", os.W_OK) and os.geteuid() != 0:
        pytest.skip("/sys is writable here")
    expected = {"missing": "does not exist", "read_only": "not writable", "too_small": "GiB free"}[case]
    errors = run_distributed(_init_error, 2, path, 1000 if case == "too_small" else None, timeout=60)
    for err in errors:
        assert "zero_optimization.offload_optimizer.nvme_path" in err and expected in err, err


# --- during training -----------------------------------------------------------------------------------
def _fault(path: str, kind: str) -> dict[str, Any]:
    from zerospeed import comm
    from zerospeed.offload import swapper

    engine = _engine(2, _nvme(path))
    _train(engine, 0, 2)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    stepper = engine.optimizer.stepper
    if comm.get_rank() == 0:
        if kind == "truncate":
            victim = stepper.swapper.path(stepper.subgroups[0][1].name)
            os.truncate(victim, 100)
        else:
            def broken(*args: Any) -> int:
                raise OSError(errno.EIO if kind == "read" else errno.ENOSPC, os.strerror(errno.EIO))

            setattr(swapper, "_pread" if kind == "read" else "_pwrite", broken)
    raised = ""
    try:
        _train(engine, 2, 1)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        raised = f"{type(exc).__name__}: {exc}"
    unchanged = all(torch.equal(v, engine.module.state_dict()[k]) for k, v in before.items())
    try:
        _train(engine, 3, 1)
        again = ""
    except RuntimeError as exc:
        again = str(exc)
    stepper.close()
    return {"raised": raised, "unchanged": unchanged, "again": again}


@pytest.mark.parametrize("kind", ["read", "write", "truncate"])
def test_io_failure_during_training_names_the_file_and_spares_the_weights(kind: str, tmp_path) -> None:
    r0, r1 = run_distributed(_fault, 2, str(tmp_path), kind, timeout=120)
    assert r0["raised"].startswith("OffloadIOError") and ".swp" in r0["raised"] and str(tmp_path) in r0["raised"], r0
    # A truncated file is caught by the next transfer of it: under stages 2-3 that is the gradient write
    # of the backward (the region write checks the file's size first), else the state read of the step.
    assert {"read": "read", "write": "write", "truncate": "truncated"}[kind] in r0["raised"]
    assert "another rank" in r1["raised"], r1
    for r in (r0, r1):
        assert r["unchanged"], "the failed step changed the model weights"
        assert "inconsistent" in r["again"]


# --- checkpoints -----------------------------------------------------------------------------------------
def _resume(path: str, ckpt: str, save_offload: dict[str, Any], load_offload: dict[str, Any]) -> dict[str, Any]:
    straight = _engine(2, save_offload)
    full = _train(straight, 0, 6)
    first = _engine(2, save_offload)
    _train(first, 0, 3)
    first.save_checkpoint(ckpt, tag="t3")
    second = _engine(2, load_offload)
    second.load_checkpoint(ckpt, tag="t3")
    resumed = _train(second, 3, 3)
    return {"full": full[3:], "resumed": resumed,
            "state": {k: v.clone() for k, v in second.module.state_dict().items()},
            "ref": {k: v.clone() for k, v in straight.module.state_dict().items()}}


@pytest.mark.parametrize("save,load", [("nvme", "nvme"), ("nvme", "none"), ("none", "nvme"), ("cpu", "nvme"), ("nvme", "cpu")])
def test_offloaded_state_round_trips_through_checkpoints(save: str, load: str, tmp_path) -> None:
    sections = {"nvme": _nvme(str(tmp_path)), "cpu": {"device": "cpu"}, "none": {"device": "none"}}
    results = run_distributed(_resume, 2, str(tmp_path), str(tmp_path / "ckpt"), sections[save], sections[load],
                              timeout=120)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["resumed"]), torch.tensor(r["full"]), rtol=1e-6, atol=1e-7)
        for k, v in r["ref"].items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-6, atol=1e-7, msg=k)
