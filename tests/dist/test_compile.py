"""engine.compile(): compiled training equals eager training under ZeRO 0-3 (+ offload), with activation
checkpointing, without recompiling in steady state; one inductor run where a C++ compiler exists."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.testing import run_distributed

from .parity import make_model, micro_batch, param_groups, reference_losses

STEPS, MB, LR = 3, 2, 1e-2
# (name, zero_optimization section, gradient accumulation steps); tiny buckets and persistence threshold so
# stage 3 really partitions
CASES = [
    ("z0", {"stage": 0}, 1),
    ("z1", {"stage": 1, "reduce_bucket_size": 200}, 1),
    ("z2", {"stage": 2, "reduce_bucket_size": 200}, 2),
    ("z3", {"stage": 3, "reduce_bucket_size": 200, "stage3_param_persistence_threshold": 0}, 1),
    ("z3-offload", {"stage": 3, "reduce_bucket_size": 200, "stage3_param_persistence_threshold": 0,
                    "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}, 2),
]


def _train(zero: dict[str, Any], backend: Any, gas: int = 1) -> tuple[list[float], dict[str, torch.Tensor],
                                                                     dict[str, Any]]:
    from torch._dynamo.testing import CompileCounterWithBackend

    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    model = make_model()
    config = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
              "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8}}}
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    facts: dict[str, Any] = {"before": engine.is_compiled}
    counter = None
    if backend is not None:
        torch._dynamo.reset()  # this engine's graphs only
        counter = CompileCounterWithBackend(backend)
        engine.compile(backend=counter, compile_kwargs={"dynamic": False if zero["stage"] < 3 else None})
        engine.compile(backend="this is not a backend")  # a second call does nothing
        facts["after"] = engine.is_compiled
        facts["compiled_module"] = engine.module._compiled_call_impl is not None
    losses, facts["graphs"] = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(gas):
            x, y = micro_batch(step, micro, rank, world, MB, gas)
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            total += float(loss.detach()) / gas
        facts["graphs"].append(counter.frame_count if counter else 0)
        summed = torch.tensor(total, device=comm.device_for_backend(engine.dp_group))
        comm.all_reduce(summed)
        losses.append(float(summed) / world)
    from zerospeed.zero import full_state_dict

    state = {k: v.float().clone() for k, v in full_state_dict(model, group=engine.dp_group).items()}
    facts["keys"] = sorted(state)
    return losses, state, facts


def _parity_all() -> dict[str, Any]:
    out = {}
    for name, zero, gas in CASES:
        out[name] = (_train(zero, None, gas), _train(zero, "aot_eager", gas))
    return out


def test_compiled_training_equals_eager_and_the_reference_at_every_stage() -> None:
    result = run_distributed(_parity_all, 2, timeout=240)[0]
    refs = {gas: reference_losses(STEPS, MB, gas, 2, clip=1.0, lr=LR) for gas in (1, 2)}
    for name, _, gas in CASES:
        ref_losses, ref_state = refs[gas]
        (eager_losses, eager_state, _), (losses, state, facts) = result[name]
        assert facts["before"] is False and facts["after"] is True and facts["compiled_module"], name
        assert facts["keys"] == sorted(ref_state), name  # compiled in place: no "_orig_mod." names
        graphs = facts["graphs"]
        if name in ("z0", "z1", "z2"):
            assert graphs == [1] * STEPS, (name, graphs)  # the whole forward is one graph
        else:  # a graph break at each gather/release hook; traced in the first step, reused after
            assert graphs[0] > 1 and graphs == [graphs[0]] * STEPS, (name, graphs)
        torch.testing.assert_close(losses, eager_losses, rtol=1e-6, atol=1e-6, msg=name)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6, msg=name)
        for key, ref in ref_state.items():  # parameters updated from the reduced gradients, on every stage
            torch.testing.assert_close(state[key], eager_state[key], rtol=1e-6, atol=1e-6, msg=f"{name} {key}")
            torch.testing.assert_close(state[key], ref, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")


class _Checkpointed(nn.Module):
    """A dropout region under zerospeed.checkpointing between two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(0.3)

    def region(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.b(h)))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from zerospeed import checkpointing

        h = checkpointing.checkpoint(self.region, torch.tanh(self.a(x)))
        return nn.functional.mse_loss(self.c(h), y)


def _checkpointed(stage: int, backend: Any) -> tuple[list[float], list[int]]:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    model = _Checkpointed()
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    counter = None
    if backend is not None:
        counter = CompileCounterWithBackend(backend)
        engine.compile(backend=counter)
    torch.manual_seed(1 + engine.global_rank)
    losses, graphs = [], []
    for _ in range(3):
        loss = engine(torch.randn(4, 8), torch.randn(4, 4))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        graphs.append(counter.frame_count if counter else 0)
    return losses, graphs


def _checkpointing_all() -> dict[int, Any]:
    return {stage: (_checkpointed(stage, None), _checkpointed(stage, "aot_eager")) for stage in (0, 3)}


def test_activation_checkpointing_under_compile_equals_eager() -> None:
    for rank_result in run_distributed(_checkpointing_all, 2, timeout=180):
        for stage, ((eager, _), (compiled, graphs)) in rank_result.items():
            assert compiled == eager, stage  # same dropout masks, bitwise: the region recomputes eagerly
            assert graphs[0] > 0 and graphs[-1] == graphs[0], (stage, graphs)  # compiled once, then reused


def _gpt_graphs() -> dict[str, Any]:
    from torch._dynamo.testing import CompileCounterWithBackend

    from zerospeed.models.gpt import GPT, GPTConfig

    torch._dynamo.reset()
    model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16), seed=0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}}
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    counter = CompileCounterWithBackend("aot_eager")
    engine.compile(backend=counter)
    gen = torch.Generator().manual_seed(engine.global_rank)
    graphs = []
    for _ in range(3):
        idx = torch.randint(0, 256, (2, 16), generator=gen)
        _, loss = engine(idx, idx)
        engine.backward(loss)
        engine.step()
        graphs.append(counter.frame_count)
    return {"graphs": graphs, "norm": engine.get_global_grad_norm()}


def test_stage3_gpt_compiles_once_with_tied_weights() -> None:
    """Two blocks of the same shapes, embeddings and a tied head: no recompilation after the first step."""
    result = run_distributed(_gpt_graphs, 2, timeout=180)[0]
    graphs = result["graphs"]
    assert graphs[0] > 1 and graphs == [graphs[0]] * 3, graphs
    assert result["norm"] > 0


def _refusals() -> list[str]:
    model = make_model()
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model),
                                           config={"train_micro_batch_size_per_gpu": 1,
                                                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    out = []
    for kwargs in ({"schedule": [(0, ["z3"])]}, {"compiled_autograd_enabled": True}, {"compile_kwargs": ["x"]}):
        try:
            engine.compile(backend="eager", **kwargs)
        except (NotImplementedError, ValueError) as exc:
            out.append(str(exc))
    assert not engine.is_compiled
    import warnings

    for dynamic in (None, False):
        model = make_model()
        engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3}})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.compile(backend="eager", compile_kwargs={"dynamic": dynamic})
        out.append(" | ".join(str(w.message) for w in caught))
    return out


def test_compile_refuses_what_it_does_not_build() -> None:
    messages = run_distributed(_refusals, 2, timeout=60)[0]
    assert len(messages) == 5
    assert messages[3] == ""  # stage 3, dynamic shapes left to dynamo: no warning
    assert "dynamic" in messages[4] and "recompile_limit" in messages[4]
    assert "schedule" in messages[0] and "not supported yet" in messages[0]
    assert "compiled_autograd_enabled" in messages[1] and "not supported yet" in messages[1]
    assert "compile_kwargs" in messages[2]


def _inductor() -> tuple[list[float], list[float]]:
    zero = {"stage": 2, "reduce_bucket_size": 200}
    return _train(zero, None)[0], _train(zero, "inductor")[0]


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="inductor on CPU needs a C++ compiler")
def test_inductor_compiled_training_matches_eager() -> None:
    import torch._inductor.config

    # Compile the same graphs once here: the forked ranks find them in inductor's cache instead of both
    # running the C++ compiler at once (CI has 2 cores).
    torch._inductor.config.compile_threads = 1
    model = torch.compile(make_model(), backend="inductor", dynamic=False)
    model(*micro_batch(0, 0, 0, 2, MB, 1)).backward()
    torch._dynamo.reset()  # keep the code on disk only: later forks start with no compiled frames
    eager, compiled = run_distributed(_inductor, 2, timeout=300)[0]
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
