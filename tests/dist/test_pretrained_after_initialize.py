"""``load_pretrained_shards`` after ``initialize``: the loaded values reach the optimizer's master, so the next
``save_checkpoint`` holds them and training continues from them as a one-process run from those weights.

Found under issue 35: with parameter offload (and wherever the fp32 master is a separate tensor: optimizer
offload to NVMe, 16-bit compute, stages 1-2) the shards took the new values but the master kept the old ones,
and the checkpoint (written from the master) lost the load.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .ckpt_common import GLOBAL_MICRO, MB, train
from .parity import make_model, param_groups, reference_losses

STEPS = 2


def _load_save_train(weights: str, ckpt: str, extra: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[float]]:
    import zerospeed
    from zerospeed import comm
    from zerospeed.compat.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from zerospeed.zero.stage3.pretrained import load_pretrained_shards

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GLOBAL_MICRO // comm.get_world_size(),
        "gradient_clipping": 0.5, "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 200, "allgather_bucket_size": 300,
                              "stage3_param_persistence_threshold": 0},
    }
    for key, value in extra.items():
        config[key] = {**config.get(key, {}), **value}
    model = make_model(seed=7)  # not the weights the run should end up with
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    load_pretrained_shards(engine.module, weights)
    engine.save_checkpoint(ckpt, tag="loaded")
    saved = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="loaded")
    return saved, train(engine, STEPS)


def _case(case: str, nvme: str) -> tuple[dict[str, Any], bool]:
    """The config added to stage 3's, and whether the model computes in bf16."""
    if case == "offload_param_cpu":
        return {"zero_optimization": {"offload_param": {"device": "cpu"}}}, False
    if case == "offload_nvme":
        return {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": nvme},
                                      "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}, False
    return {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, True


@pytest.mark.parametrize("case", ["offload_param_cpu", "offload_nvme", "stage2_bf16"])
def test_loaded_weights_reach_checkpoint_and_training(tmp_path, case: str) -> None:
    from safetensors.torch import save_file

    extra, bf16 = _case(case, str(tmp_path))
    weights = {k: v.detach().clone().contiguous() for k, v in make_model().state_dict().items()}
    save_file(weights, str(tmp_path / "w.safetensors"))
    results = run_distributed(_load_save_train, 2, str(tmp_path / "w.safetensors"), str(tmp_path / "ckpt"), extra,
                              timeout=120)
    saved, losses = results[0]
    as_stored = (lambda t: t.to(torch.bfloat16).float()) if bf16 else (lambda t: t.float())
    for name, value in weights.items():  # the checkpoint holds the loaded values, not seed 7's
        torch.testing.assert_close(as_stored(saved[name]), as_stored(value), rtol=0, atol=0, msg=name)
    if not bf16:  # and training continues from them, as one process started from those weights
        sched_free, _ = reference_losses(STEPS, MB, GLOBAL_MICRO // 2, 2, clip=0.5)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(sched_free), rtol=1e-5, atol=1e-6)
        assert results[1][1] == losses
