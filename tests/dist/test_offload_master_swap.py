"""NVMe offload swaps the fp32 master too: between steps and during the step no master partition is
resident (``memory_breakdown()["master"] == 0``), while training matches the non-offloaded run (fp32,
world 2, stages 1, 2 and 3, rtol 1e-5) and a closed engine keeps a usable master."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .parity import make_model, micro_batch, param_groups, reference_losses
from .test_offload_parity import CLIP, GAS, MB, STEPS, SUB_GROUP
from .zero3_fixtures import reference as zero3_reference
from .zero3_fixtures import run_engine as zero3_run_engine


class _Spy:
    """Wraps the stepper's flat kernel: records the resident master bytes while each sub-group steps."""

    def __init__(self, kernel: Any, engine: Any, seen: list[int]) -> None:
        self.kernel, self.engine, self.seen = kernel, engine, seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)

    def step(self, *args: Any, **kwargs: Any) -> None:
        self.seen.append(self.engine.memory_breakdown()["master"])
        self.kernel.step(*args, **kwargs)


def _stage12(stage: int, path: str) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-8, "betas": [0.9, 0.999]}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 300,
                              "sub_group_size": SUB_GROUP,
                              "offload_optimizer": {"device": "nvme", "nvme_path": path, "buffer_count": 3}},
        "steps_per_print": 1000,
    }
    engine, opt, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    during: list[int] = []
    opt.stepper.kernel = _Spy(opt.stepper.kernel, engine, during)
    between, losses = [engine.memory_breakdown()["master"]], []
    for step in range(STEPS):
        total = torch.zeros(())
        for m in range(GAS):
            x, y = micro_batch(step, m, rank, world, MB, GAS)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / GAS
        between.append(engine.memory_breakdown()["master"])
        comm.all_reduce(total)
        losses.append(float(total) / world)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    numel = sum(g.master.numel() for g in opt.groups)
    parked = [g.master_range(0, g.master.numel()).clone() for g in opt.groups]
    opt.stepper.close()  # the swap files go: the master comes back into memory, unchanged
    back = [g.master.clone() for g in opt.groups]
    return {"losses": losses, "state": state, "between": between, "during": during, "numel": numel,
            "closed_master": engine.memory_breakdown()["master"],
            "same_after_close": all(torch.equal(a, b) for a, b in zip(parked, back))}


@pytest.mark.parametrize("stage", [1, 2])
def test_nvme_master_not_resident_stage_1_2(stage: int, tmp_path) -> None:
    ref_losses, ref_state = reference_losses(STEPS, MB, GAS, 2, CLIP)
    for r in run_distributed(_stage12, 2, stage, str(tmp_path), timeout=120):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6, msg=f"parameter {k}")
        assert r["numel"] > 0
        assert r["between"] == [0] * (STEPS + 1), r["between"]
        assert r["during"] and set(r["during"]) == {0}, "the master was materialised during the step"
        assert r["same_after_close"] and r["closed_master"] == r["numel"] * 4


def _stage3(path: str) -> dict[str, Any]:
    offload = {"device": "nvme", "nvme_path": path, "buffer_count": 3}
    return zero3_run_engine(3, STEPS, MB, GAS, CLIP, None, {"offload_optimizer": offload, "sub_group_size": SUB_GROUP})


def test_nvme_master_not_resident_stage_3(tmp_path) -> None:
    ref_losses, ref_state, ref_eval = zero3_reference(STEPS, MB, GAS, 2, CLIP)
    for r in run_distributed(_stage3, 2, str(tmp_path), timeout=120):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k, v in ref_state.items():  # the fp32 export reads the parked master from the swap files
            torch.testing.assert_close(r["fp32"][k].float(), v.float(), rtol=1e-5, atol=1e-6, msg=f"fp32 {k}")
        assert r["eval"] == pytest.approx(ref_eval, rel=1e-5)
        assert r["memory"]["master"] == 0 and r["memory"]["params"] > 0
