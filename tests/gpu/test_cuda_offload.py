"""Offload on CUDA/NCCL (skipped without a device): ZeRO-Offload (cpu) and ZeRO-Infinity (nvme optimizer
state, nvme parameters) match the single-process reference at stages 1-3, with the gradient partitions on
the host where the optimizer runs (cpu offload: ``HostGrads``, copied off the device on a side stream into
pinned buffers; nvme at stages 2-3: the swap files) and the fp32 master off the device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from ..dist.parity import make_model, micro_batch, param_groups, reference_losses

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS, MB, GAS, CLIP = 6, 2, 2, 0.5


def _world() -> int:
    return 2 if torch.cuda.device_count() >= 2 else 1


def _run(stage: int, gas: int, zero_extra: dict[str, Any]) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 300,
                              "sub_group_size": 64, **zero_extra},
        "steps_per_print": 1000,
    }
    engine, opt, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    dev = engine.device
    losses = []
    for step in range(STEPS):
        total = torch.zeros((), device=dev)
        for m in range(gas):
            x, y = micro_batch(step, m, rank, world, MB, gas)
            loss = engine(x.to(dev), y.to(dev))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / gas
        comm.all_reduce(total)
        losses.append(float(total) / world)
    sink = opt.reducer.sink
    out = {"losses": losses, "device": dev.type, "sink": type(sink).__name__ if sink is not None else None,
           "sink_on_host": sink is None or not sink.resident or all(p.device.type == "cpu" for p in sink.parts),
           "device_partitions": [True for owner, _ in opt.reducer.owned_tensors() if owner == "grad_partitions"],
           "masters_on_host": all(g.master is None or g.master.device.type == "cpu" for g in opt.groups)}
    if opt.stepper is not None:
        opt.stepper.close()
    return out


def _check(results: list[dict[str, Any]], world: int, gas: int) -> None:
    ref, _ = reference_losses(STEPS, MB, gas, world, CLIP)
    for r in results:
        assert r["device"] == "cuda"
        # TF32 may be on for matmuls on the device: a looser tolerance than CPU's 1e-5.
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref), rtol=2e-3, atol=1e-4)
        assert r["masters_on_host"] and r["sink_on_host"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cpu_offload_parity_cuda(stage: int) -> None:
    world = _world()
    gas = GAS * 2 // world
    results = run_distributed(_run, world, stage, gas, {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
                              backend="nccl", timeout=300)
    _check(results, world, gas)
    for r in results:
        assert r["sink"] == "HostGrads" and not any(r["device_partitions"]), "gradient partitions on the device"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_offload_parity_cuda(stage: int, tmp_path) -> None:
    world = _world()
    gas = GAS * 2 // world
    offload = {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3, "pin_memory": True}
    results = run_distributed(_run, world, stage, gas, {"offload_optimizer": offload}, backend="nccl", timeout=300)
    _check(results, world, gas)
    for r in results:
        assert r["sink"] == ("SwappedGrads" if stage >= 2 else None)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_param_offload_parity_cuda(device: str, tmp_path) -> None:
    world = _world()
    gas = GAS * 2 // world
    param: dict[str, Any] = {"device": device, "buffer_count": 2, "buffer_size": 64, "pin_memory": True}
    optimizer: dict[str, Any] = {"device": "cpu", "pin_memory": True}
    if device == "nvme":
        param.update(nvme_path=str(tmp_path), max_in_cpu=0)
        optimizer = {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3}
    results = run_distributed(_run, world, 3, gas, {"offload_param": param, "offload_optimizer": optimizer,
                                                    "stage3_param_persistence_threshold": 0},
                              backend="nccl", timeout=300)
    _check(results, world, gas)
