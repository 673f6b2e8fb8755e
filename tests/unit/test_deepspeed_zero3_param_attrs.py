"""DeepSpeed's ``ds_*`` attributes of ZeRO-3 parameters (what transformers, PEFT and TRL read), kept true by
the stage-3 runtime: one process, parameters cut by parameter offload (world 1 keeps them whole otherwise)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import zerospeed


def test_ds_attributes_follow_the_stage3_state() -> None:
    from zerospeed.runtime.zero.partition_parameters import ZeroParamStatus

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    full = model[0].weight.detach().clone()
    engine, *_ = zerospeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                              "stage3_param_persistence_threshold": 0}})
    w = model[0].weight
    assert isinstance(w, nn.Parameter) and hasattr(w, "ds_id") and w.shape == (0,)
    assert (w.ds_numel, w.ds_shape, w.ds_persist, w.partition_numel()) == (35, torch.Size([7, 5]), False, 35)
    assert w.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert torch.equal(w.ds_tensor, full.reshape(-1))
    assert len({p.ds_id for p in model.parameters()}) == 4
    with zerospeed.zero.GatheredParameters([w]):
        assert w.ds_status == ZeroParamStatus.AVAILABLE and w.shape == (7, 5)
    engine.backward(engine(torch.randn(2, 5)).square().sum())
    engine.step()
    assert w.ds_status == ZeroParamStatus.NOT_AVAILABLE and not torch.equal(w.ds_tensor, full.reshape(-1))
    assert not hasattr(nn.Linear(2, 2).weight, "ds_id")
    assert not hasattr(copy.deepcopy(w), "ds_numel")  # a copy is not in the stage-3 table
