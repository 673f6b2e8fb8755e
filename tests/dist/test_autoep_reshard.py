"""AutoEP checkpoints reshard across ``autoep_size`` with the experts' Adam state intact (DeepSpeed issue 8147).

A tiny HF MoE model trains 2 Adam steps at one ep size (world 2), is saved, and is loaded at another (ep 1 = dp 2
<-> ep 2), then trains 2 more. Right after the load, each expert's ``exp_avg`` / ``exp_avg_sq`` / fp32 master,
read by global expert id (``safe_get_full_optimizer_state``), equals the uninterrupted single-process run's after
step 2; after the 2 more steps, the losses and the moments equal its steps 3-4. A stale, zeroed or misplaced
expert moment (a slice read at the wrong global offset) fails both checks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed import comm
from zerospeed.testing import run_distributed
from zerospeed.zero.fragments import safe_get_full_fp32_param, safe_get_full_optimizer_state

from .autoep_fixtures import batch, engine_config, loss_of, tiny_moe

MB, LR, SAVED, MORE = 2, 0.01, 2, 2
KEYS = ("exp_avg", "exp_avg_sq")


def _by_global_id(model: nn.Module, first: int) -> dict[str, torch.Tensor]:
    """Every parameter's master and Adam moments; an expert weight split into one entry per global expert id
    (``<name>.E<id>.<key>``). Collective over each parameter's partition group (every rank, same order)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        for key in ("master", *KEYS):
            t = safe_get_full_fp32_param(p) if key == "master" else safe_get_full_optimizer_state(p, key)
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                for local in range(t.shape[0]):
                    out[f"{name}.E{first + local}.{key}"] = t[local].clone()
            else:
                out[f"{name}.{key}"] = t.clone()
    return out


def _run(family: str, ep: int, stage: int, path: str, load: bool) -> tuple[list[float], dict, dict]:
    """Train ``SAVED`` steps and save, or load and train ``MORE``; the state after the load and at the end."""
    world = comm.get_world_size()
    model = tiny_moe(family, seed=3 if load else 0)  # loading: other initial values, all must come from the file
    cfg = engine_config(stage, ep, MB, world, LR, adam=True)
    cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == 4 // ep
    first = experts.global_expert_ids()[0]
    if not load:
        losses = _steps(engine, 0, SAVED)
        engine.save_checkpoint(path, tag="t")
        return losses, {}, _by_global_id(model, first)
    engine.load_checkpoint(path, tag="t")
    assert engine.global_steps == SAVED
    loaded = _by_global_id(model, first)
    return _steps(engine, SAVED, MORE), loaded, _by_global_id(model, first)


def _steps(engine: Any, first: int, n: int) -> list[float]:
    losses = []
    for step in range(first, first + n):
        loss = loss_of(engine, *batch(step, comm.get_rank(), MB))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _reference(family: str, world: int) -> tuple[list[list[float]], list[dict[str, torch.Tensor]]]:
    """The uninterrupted run in one process (each rank's micro-batch, losses averaged): per-rank losses of every
    step, and the state by global expert id after ``SAVED`` and after ``SAVED + MORE`` steps."""
    model = tiny_moe(family)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, states = [], []
    for step in range(SAVED + MORE):
        opt.zero_grad()
        per_rank = [loss_of(model, *batch(step, r, MB)) for r in range(world)]
        (sum(per_rank) / world).backward()
        opt.step()
        losses.append([float(x.detach()) for x in per_rank])
        if step + 1 in (SAVED, SAVED + MORE):
            states.append(_reference_state(model, opt))
    return losses, states


def _reference_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        values = {"master": p.detach(), **{k: opt.state[p][k] for k in KEYS}}
        for key, t in values.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                out.update({f"{name}.E{e}.{key}": t[e].clone() for e in range(t.shape[0])})
            else:
                out[f"{name}.{key}"] = t.clone()
    return out


def _check(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], when: str) -> None:
    assert sorted(got) == sorted(want)
    assert sum(".E" in k for k in got) == 2 * 2 * 4 * 3  # layers x weights x experts x (master + 2 moments)
    for key, t in want.items():  # atol scaled to each tensor (exp_avg_sq is ~1e-6): float noise, not a stale moment
        if "k_proj.bias" in key:  # Qwen2's key bias: its true gradient is 0 (softmax), Adam amplifies float noise
            continue
        torch.testing.assert_close(got[key], t, rtol=1e-5, atol=1e-5 * float(t.abs().max()),
                                   msg=lambda m, key=key: f"{when} {key}: {m}")


def _merged(results: list[tuple[Any, ...]], index: int) -> dict[str, torch.Tensor]:
    """The ranks' states merged: every global expert id once (at ep 1, each rank holds all of them: equal)."""
    out: dict[str, torch.Tensor] = {}
    for res in results:
        for k, t in res[index].items():
            if k in out:
                torch.testing.assert_close(t, out[k], rtol=0, atol=0)
            out[k] = t
    return out


@pytest.mark.parametrize("family,saved,loaded", [("mixtral", (1, 2), (2, 1)), ("qwen2_moe", (2, 3), (1, 2))])
def test_reshard_keeps_expert_adam_state(tmp_path, family: str, saved: tuple[int, int],
                                         loaded: tuple[int, int]) -> None:
    """(ep, ZeRO stage) when saved and when loaded: ep 1 (dp 2, ZeRO-2) -> ep 2 (ZeRO-1) on Mixtral, and
    ep 2 (ZeRO-3) -> ep 1 (ZeRO-2) on Qwen2-MoE (shared expert); world 2 both times."""
    ref_losses, (at_save, at_end) = _reference(family, 2)
    path = str(tmp_path)
    first = run_distributed(_run, 2, family, *saved, path, False, timeout=120)
    for rank, (losses, _, _) in enumerate(first):
        assert losses == pytest.approx([r[rank] for r in ref_losses[:SAVED]], rel=1e-5)
    _check(_merged(first, 2), at_save, "saved")
    second = run_distributed(_run, 2, family, *loaded, path, True, timeout=120)
    _check(_merged(second, 1), at_save, "after the load")
    for rank, (losses, _, _) in enumerate(second):
        assert losses == pytest.approx([r[rank] for r in ref_losses[SAVED:]], rel=1e-5)
    _check(_merged(second, 2), at_end, "after the continued steps")
