"""DeepSpeed's initialize() contract: the 4-tuple, the data loader, accessors, client objects, bad input."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import zerospeed
from zerospeed.config import ConfigError
from zerospeed.testing import run_distributed

CONFIG = {"train_batch_size": 8, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}}}


def _contract() -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    engine, opt, loader, sched = zerospeed.initialize(model=model, model_parameters=model.parameters(),
                                                      training_data=data, config=CONFIG)
    seen = []
    boundaries = []
    for x, y in loader:
        seen.extend(x[:, 0].tolist())
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.step()
    return {"sizes": (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                      engine.gradient_accumulation_steps()),
            "steps": engine.global_steps, "samples": engine.global_samples, "micro": engine.micro_steps,
            "boundaries": boundaries, "seen": seen, "lr": engine.get_lr(), "sched_iter": sched.last_batch_iteration,
            "same_opt": opt is engine.optimizer, "norm": engine.get_global_grad_norm(), "module": engine.module is model}


def test_initialize_contract() -> None:
    r0, r1 = run_distributed(_contract, 2)
    assert r0["sizes"] == (8, 2, 2)
    assert r0["micro"] == 8 and r0["steps"] == 4 and r0["samples"] == 32
    assert r0["boundaries"] == [False, True] * 4
    assert sorted(r0["seen"] + r1["seen"]) == sorted(set(r0["seen"] + r1["seen"]))  # disjoint shards
    assert len(r0["seen"]) == 16
    assert r0["sched_iter"] == 3 and r0["same_opt"] and r0["module"] and r0["norm"] > 0


def _client_objects() -> list[float]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine, zopt, _, lr_sched = zerospeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                                     config={"train_micro_batch_size_per_gpu": 2,
                                                             "zero_optimization": {"stage": 1}})
    assert lr_sched is sched and zopt.optimizer is opt
    lrs = []
    for _ in range(3):
        loss = engine(torch.ones(2, 4)).sum()
        engine.backward(loss)
        engine.step()
        lrs.append(engine.get_lr()[0])
    return lrs


def test_client_optimizer_and_scheduler_keep_working() -> None:
    for lrs in run_distributed(_client_objects, 2):
        assert lrs == pytest.approx([0.05, 0.025, 0.0125])


def _bad(case: str) -> str:
    model = nn.Linear(2, 2)
    try:
        if case == "no_model":
            zerospeed.initialize(config={"train_batch_size": 2})
        elif case == "world":
            zerospeed.initialize(model=model, config={"train_batch_size": 3})
        elif case == "both_optimizers":
            zerospeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1),
                                 config={"train_batch_size": 2, "optimizer": {"type": "Adam"}})
        elif case == "lamb_zero":
            zerospeed.initialize(model=model, config={"train_batch_size": 2, "optimizer": {"type": "Lamb"},
                                                      "zero_optimization": {"stage": 2}})
        elif case == "foreign_param":
            zerospeed.initialize(model=model, model_parameters=[torch.nn.Parameter(torch.ones(2))],
                                 config={"train_batch_size": 2, "optimizer": {"type": "Adam"}})
    except (ConfigError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize(("case", "pattern"), [
    ("no_model", "needs model"),
    ("world", r"train_batch_size.*not divisible by the world size \(2\)"),
    ("both_optimizers", "client optimizer and an 'optimizer'"),
    ("lamb_zero", "zero_allow_untested_optimizer"),
    ("foreign_param", "not a parameter of the model"),
])
def test_bad_input_is_a_clear_error(case: str, pattern: str) -> None:
    import re

    for msg in run_distributed(_bad, 2, case):
        assert re.search(pattern, msg), msg


def test_unknown_initialize_argument() -> None:
    with pytest.raises(TypeError, match="unexpected"):
        zerospeed.initialize(model=nn.Linear(1, 1), config={"train_batch_size": 1}, bogus=1)
