"""An exception inside forward, backward or step on one rank abandons that step on every rank, quickly,
and the engine trains on: the following losses equal a plain-PyTorch run that never saw that batch."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .parity import global_batch, make_model, micro_batch, param_groups

STEPS, FAIL, MB, CLIP, LR = 6, 3, 2, 0.5, 1e-2
TIMEOUT_S = 6.0


class Injected(RuntimeError):
    pass


def _reference(world: int, skip: int, gas: int = 1) -> list[float]:
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, MB * gas * world)
        loss = model(x, y)
        if step == skip:
            losses.append(float("nan"))
            continue
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)
        opt.step()
        losses.append(loss.item())
    return losses


def _train(stage: int, where: str, gas: int = 1, offload: dict[str, Any] | None = None) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    model = make_model()
    config = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 300,
                                    "stage3_param_persistence_threshold": 0, **(offload or {})},
              "comms_timeout_s": TIMEOUT_S, "steps_per_print": 1000}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    armed = {"on": False}

    def fail_backward(grad: torch.Tensor) -> None:
        raise Injected("backward")

    def fail_forward(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        if armed["on"] and where == "forward":
            raise Injected("forward")
        if armed["on"] and where == "backward":  # raises in the middle of backward (head's gradients are in)
            out.register_hook(fail_backward)
        return out

    model.fc2.register_forward_hook(fail_forward)
    collect = engine.optimizer._collect_grads

    def fail_step() -> Any:
        if armed["on"]:
            raise Injected("step: out of memory copying the gradients to fp32")
        return collect()

    if where == "step":
        engine.optimizer._collect_grads = fail_step
    losses: list[float] = []
    failures: list[tuple[int, str, float]] = []
    for step in range(STEPS):
        t0 = time.monotonic()
        total = torch.zeros(())
        try:
            for m in range(gas):  # rank 1 fails in the first micro-step; rank 0 (stages 0-1) in the last
                armed["on"] = rank == 1 and step == FAIL and m == 0
                x, y = micro_batch(step, m, rank, world, MB, gas)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                total += loss.detach().float() / gas
        except Exception as exc:  # noqa: BLE001 - the loop a user writes: skip the batch, go on
            failures.append((step, f"{type(exc).__name__}: {exc}", time.monotonic() - t0))
            losses.append(float("nan"))
            continue
        comm.all_reduce(total)  # the user's own collective, on the world group
        losses.append(float(total) / world)
    return {"losses": losses, "failures": failures, "global_steps": engine.global_steps}


@pytest.mark.parametrize("stage,where,gas", [(s, w, 1) for s in (0, 1, 2, 3) for w in ("forward", "backward", "step")]
                         + [(1, "forward", 2), (2, "backward", 2)])
def test_exception_on_one_rank_abandons_the_step_everywhere(stage: int, where: str, gas: int) -> None:
    ref = _reference(2, FAIL, gas)
    results = run_distributed(_train, 2, stage, where, gas, timeout=90)
    _check(results, ref)


def _check(results: list[dict[str, Any]], ref: list[float]) -> None:
    for rank, r in enumerate(results):
        assert [f[0] for f in r["failures"]] == [FAIL], (rank, r["failures"])
        _, message, elapsed = r["failures"][0]
        assert elapsed < TIMEOUT_S / 2, f"rank {rank} raised after {elapsed:.1f} s (not the timeout path)"
        if rank == 1:
            assert message.startswith("Injected"), message
        else:
            assert "CollectiveError" in message and "rank 0" in message, message
        got = [v for i, v in enumerate(r["losses"]) if i != FAIL]
        want = [v for i, v in enumerate(ref) if i != FAIL]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
        assert r["global_steps"] == STEPS - 1


def _fails_inside_update() -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm

    rank = comm.get_rank()
    model = make_model()
    config = {"train_micro_batch_size_per_gpu": MB, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 200}, "comms_timeout_s": TIMEOUT_S}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    base_step = engine.optimizer.optimizer.step

    def broken(*a: Any, **k: Any) -> Any:
        if rank == 1:
            raise Injected("inside the torch optimizer's step")
        return base_step(*a, **k)

    engine.optimizer.optimizer.step = broken
    messages = []
    for step in range(2):
        try:
            x, y = micro_batch(step, 0, rank, 2, MB, 1)
            engine.backward(engine(x, y))
            engine.step()
        except Exception as exc:  # noqa: BLE001
            messages.append(str(exc))
    return {"messages": messages}


def test_failure_inside_the_update_stops_the_engine_on_every_rank() -> None:
    """After the commit point some ranks may have changed their weights: refuse to go on, everywhere."""
    for r in run_distributed(_fails_inside_update, 2, timeout=60):
        assert len(r["messages"]) == 2, r
        assert "inconsistent" in r["messages"][1] and "checkpoint" in r["messages"][1], r


def _offload_kernel_fails() -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm

    rank = comm.get_rank()
    model = make_model()
    config = {"train_micro_batch_size_per_gpu": MB, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 200, "offload_optimizer": {"device": "cpu"}},
              "comms_timeout_s": 20.0}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    stepper = engine.optimizer.stepper

    class Broken:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def step(self, *a: Any, **k: Any) -> None:
            raise ValueError("not an I/O error: the CPU kernel failed")

    real = stepper.kernel
    if rank == 0:
        stepper.kernel = Broken()
    messages = []
    for step in range(2):
        t0 = time.monotonic()
        try:
            x, y = micro_batch(step, 0, rank, 2, MB, 1)
            engine.backward(engine(x, y))
            engine.step()
        except Exception as exc:  # noqa: BLE001
            messages.append((f"{type(exc).__name__}: {exc}", time.monotonic() - t0))
    return {"messages": messages}


def test_offload_failure_of_any_type_is_agreed_across_ranks() -> None:
    r0, r1 = run_distributed(_offload_kernel_fails, 2, timeout=90)
    assert [len(r["messages"]) for r in (r0, r1)] == [2, 2], (r0, r1)
    assert r0["messages"][0][0].startswith("ValueError: not an I/O error"), r0
    assert "another rank" in r1["messages"][0][0] and r1["messages"][0][1] < 10, r1
    for r in (r0, r1):
        assert "inconsistent" in r["messages"][1][0], r


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_offloaded_stage3_recovers_too(where: str, tmp_path) -> None:
    """ZeRO-Infinity: parameter shards on disk, optimizer state offloaded; a failed step leaves nothing
    read in or half-gathered behind."""
    offload = {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2,
                                 "buffer_size": 64, "max_in_cpu": 0},
               "offload_optimizer": {"device": "cpu"}}
    _check(run_distributed(_train, 2, 3, where, 1, offload, timeout=90), _reference(2, FAIL))
