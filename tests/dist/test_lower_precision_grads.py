"""``torch_autocast.lower_precision_safe_modules`` at world 2, ZeRO 1-3: the gradients of the safe modules'
parameters are reduced in the autocast dtype (bf16), the others in fp32, and accumulated in fp32, as in
DeepSpeed (per-dtype IPG buckets). The one-process reference applies the same rule to each rank's gradient:
``bf16(bf16(g0) + bf16(g1)) / 2`` for a safe parameter, ``(g0 + g1) / 2`` in fp32 for the others."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from zerospeed.testing import run_distributed

WORLD, MB, STEPS, LR = 2, 2, 2, 1e-2
LAYER_NORM = "torch.nn.modules.normalization.LayerNorm"


class Net(nn.Module):
    """Linear layers (safe by default) around a LayerNorm (not)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(torch.tanh(self.norm(self.fc1(x)))).float(), y)


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(MB * WORLD, 8, generator=g) * 3, torch.randn(MB * WORLD, 4, generator=g)
    return x[rank * MB:(rank + 1) * MB], y[rank * MB:(rank + 1) * MB]


def _config(stage: int, safe: list[str] | None) -> dict[str, Any]:
    autocast: dict[str, Any] = {"enabled": True, "dtype": "bfloat16"}
    if safe is not None:
        autocast["lower_precision_safe_modules"] = safe
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": 1, "zero_optimization": zero,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}, "torch_autocast": autocast}


def _train(cases: list[tuple[int, list[str] | None]]) -> list[dict[str, Any]]:
    import zerospeed
    from zerospeed import comm
    from zerospeed.zero import full_state_dict
    from zerospeed.zero.fragments import safe_get_full_grad

    out = []
    for stage, safe in cases:
        model = _model()
        engine, *_ = zerospeed.initialize(model=model, config=_config(stage, safe))
        grads = []
        for step in range(STEPS):
            loss = engine(*_batch(step, comm.get_rank()))
            engine.backward(loss)
            grads.append({n: safe_get_full_grad(p).detach().clone() for n, p in model.named_parameters()})
            engine.step()
        params = full_state_dict(engine.module, engine.optimizer, fp32=True, rank0_only=False)
        out.append({"grads": grads, "params": {k: v.detach().clone() for k, v in params.items()}})
        engine.destroy()
    return out


def _reference(safe_types: tuple[type, ...]) -> dict[str, Any]:
    """One process: each rank's gradient under the same autocast, reduced by the dtype rule; AdamW."""
    model = _model()
    low = {id(p) for m in model.modules() if type(m) in safe_types for p in m.parameters(recurse=False)}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    grads = []
    for step in range(STEPS):
        per_rank = []
        for rank in range(WORLD):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(*_batch(step, rank))
            loss.backward()
            per_rank.append([p.grad.clone() for p in model.parameters()])
        for p, (g0, g1) in zip(model.parameters(), zip(*per_rank)):
            if id(p) in low:
                p.grad = (g0.bfloat16().float() + g1.bfloat16().float()).bfloat16().float() * 0.5
            else:
                p.grad = (g0 + g1) * 0.5
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return {"grads": grads, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


CASES: list[tuple[int, list[str] | None]] = [(1, None), (2, None), (3, None), (2, [LAYER_NORM])]


@pytest.fixture(scope="module")
def runs() -> list[list[dict[str, Any]]]:
    return run_distributed(_train, WORLD, CASES, timeout=120)


def test_safe_modules_gradients_are_reduced_in_bf16_at_zero_1_2_3(runs: list[list[dict[str, Any]]]) -> None:
    defaults = _reference((nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))
    norm_only = _reference((nn.LayerNorm,))
    plain = _reference(())  # every gradient in fp32: what the rule must differ from
    for k, (stage, safe) in enumerate(CASES):
        want = defaults if safe is None else norm_only
        for rank in range(WORLD):
            got = runs[rank][k]
            for step in range(STEPS):
                for name, g in want["grads"][step].items():
                    torch.testing.assert_close(got["grads"][step][name], g, rtol=1e-6, atol=1e-8,
                                               msg=f"stage {stage} {safe} rank {rank} step {step}: {name}")
            for name, v in want["params"].items():
                torch.testing.assert_close(got["params"][name], v, rtol=1e-6, atol=1e-7, msg=f"stage {stage}: {name}")
    low = "fc1.weight"
    assert not torch.allclose(defaults["grads"][0][low], plain["grads"][0][low], rtol=1e-6, atol=1e-8)
    assert torch.equal(norm_only["grads"][0][low], plain["grads"][0][low])
