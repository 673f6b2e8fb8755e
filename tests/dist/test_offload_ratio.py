"""Partial offload (``offload_optimizer.ratio``): the first ``int((1 - ratio) * n)`` sub-groups step on the
device, the rest on the host in a worker thread, at the same time. The math is the same Adam: world 2 equals
full offload and a single-process torch AdamW within rtol 1e-5, at stages 2 and 3; a checkpoint saved under
one ratio resumes under another."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .parity import reference_losses
from .test_offload_parity import CLIP, GAS, MB, STEPS, run
from .zero3_fixtures import reference as zero3_reference
from .zero3_fixtures import run_engine as zero3_run_engine


def _split(st: Any) -> dict[str, Any]:
    return {"device": len(st.share.jobs) if st.share is not None else 0, "host": len(st.host_jobs)
            if st.share is not None else sum(len(s) for s in st.subgroups), "thread": st.host_thread,
            "bytes": st.state_bytes_by_home()}


def _run_ratio(stage: int, ratio: float) -> dict[str, Any]:
    import zerospeed.offload.stepper as stepper_mod

    seen: dict[str, Any] = {}
    orig = stepper_mod.OffloadStepper.step

    def spy(self: Any, grads: list[torch.Tensor]) -> None:
        orig(self, grads)
        seen.update(_split(self))

    stepper_mod.OffloadStepper.step = spy  # type: ignore[method-assign]
    try:
        if stage == 3:
            out = zero3_run_engine(3, STEPS, MB, GAS, CLIP, None, {"offload_optimizer": {"device": "cpu", "ratio": ratio},
                                                                   "sub_group_size": 64})
            out = {"losses": out["losses"], "state": out["fp32"]}
        else:
            out = run(stage, STEPS, {"device": "cpu", "ratio": ratio})
    finally:
        stepper_mod.OffloadStepper.step = orig  # type: ignore[method-assign]
    return {**out, **seen}


@pytest.mark.parametrize("stage,ratio", [(2, 0.5), (2, 0.3), (3, 0.5)])
def test_ratio_matches_full_offload_and_torch(stage: int, ratio: float) -> None:
    if stage == 3:
        ref_losses, ref_state, _ = zero3_reference(STEPS, MB, GAS, 2, CLIP)
    else:
        ref_losses, ref_state = reference_losses(STEPS, MB, GAS, 2, CLIP)
    full = run_distributed(_run_ratio, 2, stage, 1.0, timeout=120)
    part = run_distributed(_run_ratio, 2, stage, ratio, timeout=120)
    for f, p in zip(full, part):
        n = f["host"]
        assert n > 2 and p["device"] == int((1 - ratio) * n) and p["host"] == n - p["device"]  # DeepSpeed's rule
        assert p["device"] > 0 and p["thread"].startswith("zerospeed-offload")  # the host half ran beside
        assert f["thread"] != p["thread"]
        assert p["bytes"]["device"] > 0 and p["bytes"]["host"] > 0 and f["bytes"]["device"] == 0
        assert p["bytes"]["device"] + p["bytes"]["host"] == f["bytes"]["host"]
        for r in (f, p):
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
            for k, v in ref_state.items():
                torch.testing.assert_close(r["state"][k].float(), v.float(), rtol=1e-5, atol=1e-6, msg=k)
        torch.testing.assert_close(torch.tensor(p["losses"]), torch.tensor(f["losses"]), rtol=1e-5, atol=1e-6)


def _resume(tmp: str, first: float, second: float) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm

    from .parity import make_model, micro_batch, param_groups

    def engine(ratio: float) -> Any:
        model = make_model()
        cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": 2, "sub_group_size": 64, "reduce_bucket_size": 200,
                                     "offload_optimizer": {"device": "cpu", "ratio": ratio}}}
        return zerospeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)[0], model

    def train(e: Any, steps: range) -> list[float]:
        out = []
        for s in steps:
            x, y = micro_batch(s, 0, comm.get_rank(), comm.get_world_size(), MB, 1)
            loss = e(x, y)
            e.backward(loss)
            e.step()
            out.append(float(loss))
        return out

    a, _ = engine(first)
    straight = train(a, range(6))
    b, _ = engine(first)
    train(b, range(3))
    b.save_checkpoint(tmp, tag="t")
    c, _ = engine(second)
    c.load_checkpoint(tmp, tag="t")
    return {"straight": straight[3:], "resumed": train(c, range(3, 6))}


@pytest.mark.parametrize("first,second", [(0.5, 0.5), (0.5, 1.0), (1.0, 0.3)])
def test_ratio_checkpoint_round_trip(first: float, second: float, tmp_path) -> None:
    for r in run_distributed(_resume, 2, str(tmp_path), first, second, timeout=120):
        torch.testing.assert_close(torch.tensor(r["resumed"]), torch.tensor(r["straight"]), rtol=1e-5, atol=1e-6)


def _lamb_with_ratio() -> str:
    try:
        run(2, 1, {"device": "cpu", "ratio": 0.5}, optimizer="Lamb")
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return ""


def test_ratio_refuses_an_optimizer_without_flat_kernel() -> None:
    msg = run_distributed(_lamb_with_ratio, 1, timeout=60)[0]
    assert "offload_optimizer.ratio" in msg and "Lamb" in msg and "not supported yet" in msg
