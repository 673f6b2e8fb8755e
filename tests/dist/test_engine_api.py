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
        elif case == "untested_zero":  # Adafactor's factored statistics would see shards (Lamb is exact now)
            zerospeed.initialize(model=model, config={"train_batch_size": 2, "optimizer": {"type": "Adafactor"},
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
    ("untested_zero", "zero_allow_untested_optimizer"),
    ("foreign_param", "not a parameter of the model"),
])
def test_bad_input_is_a_clear_error(case: str, pattern: str) -> None:
    import re

    for msg in run_distributed(_bad, 2, case):
        assert re.search(pattern, msg), msg


def test_unknown_initialize_argument() -> None:
    with pytest.raises(TypeError, match="unexpected"):
        zerospeed.initialize(model=nn.Linear(1, 1), config={"train_batch_size": 1}, bogus=1)


def _no_sync_run(stage: int) -> list[float]:
    from .parity import make_model, micro_batch, param_groups

    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    model = make_model()
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}})
    for step in range(3):
        with engine.no_sync():
            x, y = micro_batch(step, 0, rank, world, 2, 2)
            engine.backward(engine(x, y))
        x, y = micro_batch(step, 1, rank, world, 2, 2)
        engine.backward(engine(x, y))
        engine.step()
    return [v.detach().clone() for v in model.state_dict().values()]


def _no_sync_reference(world: int) -> list:
    from .parity import global_batch, make_model, param_groups

    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, weight_decay=0.0)
    for step in range(3):
        x, y = global_batch(step, 2 * 2 * world)
        half = 2 * world  # micro 0 of every rank, then micro 1 (parity.micro_batch's layout)
        loss = model(x[:half], y[:half]) + model(x[half:], y[half:])  # each micro-batch counts whole: GAS 1
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 0.5)
        opt.step()
    return list(model.state_dict().values())


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_defers_the_reduction(stage: int) -> None:
    ref = _no_sync_reference(2)
    for state in run_distributed(_no_sync_run, 2, stage):
        for got, want in zip(state, ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _no_sync_misuse() -> list[str]:
    model = nn.Linear(2, 2)
    out = []
    for stage in (0, 2):
        engine, *_ = zerospeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                               "optimizer": {"type": "Adam"},
                                                               "zero_optimization": {"stage": stage}})
        try:
            with engine.no_sync():
                engine.backward(engine(torch.ones(1, 2)).sum())
                engine.step()
        except RuntimeError as exc:
            out.append(str(exc))
    return out


def test_no_sync_misuse_is_a_clear_error() -> None:
    for msgs in run_distributed(_no_sync_misuse, 2):
        assert "illegal to call Engine.step() inside no_sync context manager" in msgs[0]
        assert "incompatible with gradient partitioning logic of ZeRO stage 2" in msgs[1]


def _explicit_boundary() -> tuple[int, int]:
    model = nn.Linear(2, 1)
    engine, *_ = zerospeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                           "gradient_accumulation_steps": 4,
                                                           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    for boundary in (False, True, False, True):
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(engine(torch.ones(1, 2)).sum())
        engine.step()
    return engine.global_steps, engine.micro_steps


def test_explicit_accumulation_boundary() -> None:
    for steps, micro in run_distributed(_explicit_boundary, 2):
        assert (steps, micro) == (2, 4)
