"""Config keys honoured at initialize(): overlap_comm false, dump_state, hint logging, vocabulary_size,
zero_force_ds_cpu_optimizer, log_trace_cache_warnings (issue 10)."""

import contextlib
import io
import logging
import warnings

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.config import ConfigError
from zerospeed.testing import run_distributed


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _capture(name: str):
    logger, handler = logging.getLogger(name), _Records()
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _overlap(overlap: bool | None, bucket: int | None = 16) -> dict:
    """Stage 0: where do the bucket collectives start, from backward hooks or after backward?"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    zero: dict = {"stage": 0} if bucket is None else {"stage": 0, "reduce_bucket_size": bucket}
    if overlap is not None:
        zero["overlap_comm"] = overlap
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": zero}
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    reducer = engine.optimizer.reducer
    where: list[str] = []
    phase = ["hook"]
    launch, end = reducer._launch, reducer.end_micro_step

    def spy_launch(k: int) -> None:
        where.append(phase[0])
        launch(k)

    def spy_end() -> None:
        phase[0] = "after"
        end()
        phase[0] = "hook"

    reducer._launch, reducer.end_micro_step = spy_launch, spy_end
    losses = []
    g = torch.Generator().manual_seed(engine.global_rank)
    for _ in range(2):
        x = torch.randn(2, 4, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"setting": reducer.s.overlap_comm, "where": sorted(set(where)), "losses": losses,
            "buckets": sum(len(grp.plan.buckets) for grp in reducer.groups)}


def test_stage_0_buckets_overlap_backward_at_deepspeeds_default_size() -> None:
    """DeepSpeed's reduce_bucket_size (5e8) would put the model in one bucket, all-reduced after backward;
    zerospeed cuts stage 0's buckets (views of its gradient buffer) at 1/8 like DDP's, so they overlap."""
    res = run_distributed(_overlap, 2, None, None)
    assert res[0]["buckets"] > 1 and "hook" in res[0]["where"]
    assert res[0]["losses"] == pytest.approx(run_distributed(_overlap, 2, None)[0]["losses"])


def test_overlap_comm_false_is_honoured_at_stage_0() -> None:
    off = run_distributed(_overlap, 2, False)
    on = run_distributed(_overlap, 2, None)
    assert off[0]["setting"] is False and off[0]["where"] == ["after"]
    assert on[0]["setting"] is True and "hook" in on[0]["where"]
    assert off[0]["losses"] == pytest.approx(on[0]["losses"])


def _startup() -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    cfg = {"train_micro_batch_size_per_gpu": 2, "dump_state": True, "vocabulary_size": 50257,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "set_grad_none": True}},
           "zero_optimization": {"stage": 1, "contiguous_gradients": True, "memory_efficient_linear": False}}
    out = io.StringIO()
    with _capture("zerospeed.config") as lines, contextlib.redirect_stdout(out), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = zerospeed.initialize(model=model, config=cfg)
    return {"rank": engine.global_rank, "logged": lines, "printed": out.getvalue(),
            "warned": [str(w.message) for w in caught if "vocabulary_size" in str(w.message)]}


def test_dump_state_and_hints_are_reported_once_on_rank_0() -> None:
    r0, r1 = run_distributed(_startup, 2)
    assert r1["logged"] == [] and r1["printed"] == "" and r1["warned"] == []
    assert len(r0["warned"]) == 1 and "50257" in r0["warned"][0]
    assert len(r0["logged"]) == 3
    assert all("accepted as a hint" in line for line in r0["logged"])
    assert any("'zero_optimization.memory_efficient_linear'" in line for line in r0["logged"])
    text = r0["printed"]
    assert "engine state (dump_state)" in text
    for item in ("train_batch_size", "dp_world_size", "optimizer", "config.zero_optimization.stage"):
        assert f"  {item} ." in text, item
    assert "optimizer ...." in text and "AdamW" in text


def _client_sgd_offload(force: bool | None) -> str:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    cfg: dict = {"train_micro_batch_size_per_gpu": 2,
                 "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    if force is not None:
        cfg["zero_force_ds_cpu_optimizer"] = force
    try:
        engine, *_ = zerospeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          config=cfg)
    except ConfigError as exc:
        return str(exc)
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    return "ran"


def test_zero_force_ds_cpu_optimizer_refuses_a_slow_client_optimizer_by_default() -> None:
    msg = run_distributed(_client_sgd_offload, 1, None)[0]
    assert "zero_force_ds_cpu_optimizer" in msg and "SGD" in msg
    assert run_distributed(_client_sgd_offload, 1, False) == ["ran"]


class _TwoWay(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, swap: bool = False) -> torch.Tensor:
        return self.a(self.b(x)) if swap else self.b(self.a(x))


def _trace(flag: bool) -> list[str]:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "log_trace_cache_warnings": flag}}
    engine, *_ = zerospeed.initialize(model=_TwoWay(), config=cfg)
    with _capture("zerospeed.zero") as lines:
        for swap in (False, True):  # the first step records the order, the second leaves it
            engine.backward(engine(torch.ones(2, 4), swap=swap).sum())
            engine.step()
    return lines


def test_log_trace_cache_warnings() -> None:
    on = run_distributed(_trace, 2, True)[0]
    assert on and "left the recorded module order" in on[0]
    assert run_distributed(_trace, 2, False)[0] == []
