"""ZeRO-Offload reproduces the non-offloaded run: optimizer state on the host (cpu) or in swap files (nvme),
stages 1, 2 and 3, world 2, several sub-groups per rank, fp32 within rtol 1e-5 for 10 steps. Swap files
are removed when the engine goes away."""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .parity import make_model, micro_batch, param_groups, reference_losses
from .zero3_fixtures import reference as zero3_reference
from .zero3_fixtures import run_engine as zero3_run_engine

STEPS, MB, GAS, CLIP = 10, 2, 2, 0.5
SUB_GROUP = 64  # elements: several sub-groups per rank, cut through parameters


def offload_section(device: str, path: str | None) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device}
    if device == "nvme":
        section.update(nvme_path=path, buffer_count=3)
    return section


def run(stage: int, steps: int, offload: dict[str, Any], optimizer: str = "AdamW",
        sub_group_size: int = SUB_GROUP) -> dict[str, Any]:
    """Train the parity model through zerospeed; report losses, final weights and where the state lived."""
    import zerospeed
    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
        "optimizer": {"type": optimizer, "params": {"lr": 1e-2, "eps": 1e-8, **({} if optimizer == "Adagrad" else
                                                                              {"betas": [0.9, 0.999]})}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 300,
                              "sub_group_size": sub_group_size, "offload_optimizer": offload},
        "steps_per_print": 1000, "zero_allow_untested_optimizer": optimizer == "Lamb",
    }
    engine, opt, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for m in range(GAS):
            x, y = micro_batch(step, m, rank, world, MB, GAS)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / GAS
        comm.all_reduce(total)
        losses.append(float(total) / world)
    out: dict[str, Any] = {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    stepper = opt.stepper
    if stepper is None:
        return out
    out.update(subgroups=sum(len(s) for s in stepper.subgroups), disk=stepper.disk_bytes(),
               swap_dir=stepper.swapper.root if stepper.swapper is not None else None)
    stepper.close()
    out["swap_dir_left"] = out["swap_dir"] is not None and os.path.exists(out["swap_dir"])
    return out


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [1, 2])
def test_offload_parity_stage_1_2(stage: int, device: str, tmp_path) -> None:
    ref_losses, ref_state = reference_losses(STEPS, MB, GAS, 2, CLIP)
    results = run_distributed(run, 2, stage, STEPS, offload_section(device, str(tmp_path)), timeout=120)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6, msg=f"parameter {k}")
        assert r["subgroups"] > 2
        if device == "nvme":
            assert r["disk"] > 0 and not r["swap_dir_left"]
    assert os.listdir(tmp_path) == []  # every rank removed its swap files


def _zero3_run(offload: dict[str, Any]) -> dict[str, Any]:
    out = zero3_run_engine(3, STEPS, MB, GAS, CLIP, None, {"offload_optimizer": offload, "sub_group_size": SUB_GROUP})
    gc.collect()  # the engine is gone: its swapper's finalizer removes the swap files
    return out


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_parity_stage_3(device: str, tmp_path) -> None:
    ref_losses, ref_state, ref_eval = zero3_reference(STEPS, MB, GAS, 2, CLIP)
    results = run_distributed(_zero3_run, 2, offload_section(device, str(tmp_path)), timeout=120)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["fp32"][k].float(), v.float(), rtol=1e-5, atol=1e-6, msg=f"fp32 {k}")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_adagrad_matches_plain_stage_1(device: str, tmp_path) -> None:
    """Adagrad through the flat kernel equals the same engine without offload."""
    plain = run_distributed(run, 2, 1, 4, {"device": "none"}, "Adagrad", timeout=120)
    off = run_distributed(run, 2, 1, 4, offload_section(device, str(tmp_path)), "Adagrad", timeout=120)
    for a, b in zip(plain, off):
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=1e-5, atol=1e-6)
        for k, v in a["state"].items():
            torch.testing.assert_close(b["state"][k], v, rtol=1e-5, atol=1e-6, msg=f"parameter {k}")


def test_cpu_offload_of_an_optimizer_without_flat_kernel(tmp_path) -> None:
    """Lamb has no flat kernel: under cpu offload it runs its own step on the host masters."""
    plain = run_distributed(run, 2, 2, 3, {"device": "none"}, "Lamb", timeout=120)
    off = run_distributed(run, 2, 2, 3, {"device": "cpu"}, "Lamb", timeout=120)
    for a, b in zip(plain, off):
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=1e-6, atol=1e-7)
