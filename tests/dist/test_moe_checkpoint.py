"""MoE checkpoints name experts by global id: saved at ep=2, they load at ep=1 and at ep=4 (other world sizes)."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from zerospeed import comm
from zerospeed.moe.utils import is_moe_param
from zerospeed.testing import run_distributed

from .moe_fixtures import MoEGPT, batch, engine_config

MB, LR = 2, 0.5


def _engine(ep: int, stage: int, seed: int, frozen: bool = False):
    rank, world = comm.get_rank(), comm.get_world_size()
    model = MoEGPT(ep, 1, rank % ep, seed=seed)
    if frozen:  # layer 1's experts do not train: kept in the checkpoint outside the optimizer state
        for p in model.gpt.blocks[1].mlp.moe.deepspeed_moe.experts.parameters():
            p.requires_grad_(False)
    cfg = engine_config(stage, 0.0, LR, MB, world)
    cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    return engine, model


def _by_global_id(model: MoEGPT) -> dict[str, torch.Tensor]:
    with zerospeed.zero.GatheredParameters(list(model.parameters())):  # whole under stage 3
        return _whole_by_global_id(model)


def _whole_by_global_id(model: MoEGPT) -> dict[str, torch.Tensor]:
    out = {n: p.detach().clone() for n, p in model.named_parameters() if not is_moe_param(p)}
    for layer, block in enumerate(model.gpt.blocks):
        for local, gid in enumerate(block.mlp.moe.global_expert_ids()):
            for n, p in model.expert(layer, local).named_parameters():
                out[f"L{layer}.E{gid}.{n}"] = p.detach().clone()
    return out


def _steps(engine, first: int, n: int) -> list[float]:
    losses = []
    for step in range(first, first + n):
        loss = engine(*batch(step, comm.get_rank(), MB))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _save(path: str, ep: int, stage: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    engine, model = _engine(ep, stage, seed=0)
    _steps(engine, 0, 3)
    engine.save_checkpoint(path, tag="t")
    return _by_global_id(model), _steps(engine, 3, 2)


def _load(path: str, ep: int, stage: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    engine, model = _engine(ep, stage, seed=5)  # different initial values: everything must come from the file
    engine.load_checkpoint(path, tag="t")
    return _by_global_id(model), _steps(engine, 3, 2)


def _merged(results: list) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for state, _ in results:
        out.update(state)
    return out


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_ep2_checkpoint_loads_at_ep1_and_ep4(tmp_path, stage: int) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save, 2, path, 2, stage, timeout=120)
    want = _merged(saved)
    assert sum(".E" in k for k in want) == 2 * 4 * 4
    at_ep1 = run_distributed(_load, 2, path, 1, stage, timeout=120)
    got = _merged(at_ep1)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)
    for (_, cont), (_, cont_ep1) in zip(saved, at_ep1):  # the same training goes on
        assert cont_ep1 == pytest.approx(cont, rel=1e-5)
    loaded4 = run_distributed(_load_only, 4, path, 4, stage, timeout=180)
    got4 = _merged(loaded4)
    assert got4.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got4[k], want[k], rtol=0, atol=0, msg=k)
    # offline consolidation (zerospeed to-fp32): one file with every expert, loadable into the ep=1 model
    from safetensors.torch import load_file

    from zerospeed.runtime.checkpoint.consolidate import consolidate

    out = consolidate(path, str(tmp_path / "full.safetensors"), tag="t")
    full = MoEGPT(1, 1, 0)
    res = full.load_state_dict(load_file(out["path"]), strict=False)
    assert not res.unexpected_keys and set(res.missing_keys) <= {"gpt.lm_head.weight"}  # tied to gpt.wte.weight
    for k, v in _by_global_id(full).items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)


def _load_only(path: str, ep: int, stage: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    engine, model = _engine(ep, stage, seed=5)
    engine.load_checkpoint(path, tag="t")
    return _by_global_id(model), []


def _save_16bit(path: str, stage: int) -> dict[str, torch.Tensor]:
    engine, model = _engine(2, stage, seed=0)
    _steps(engine, 0, 2)
    if stage == 3:
        engine.zero3.gather_16bit_on_save = True  # stage3_gather_16bit_weights_on_model_save
    engine.save_16bit_model(path)
    return _by_global_id(model)


@pytest.mark.parametrize("stage", [0, 3])
def test_save_16bit_model_at_ep2_holds_every_expert(tmp_path, stage: int) -> None:
    """World 4, ep 2: every expert by global id in one file that an ep=1 model loads (experts cut over their
    expert-data pair under ZeRO-3)."""
    from safetensors.torch import load_file

    want = _merged([(s, []) for s in run_distributed(_save_16bit, 4, str(tmp_path), stage, timeout=180)])
    full = MoEGPT(1, 1, 0, seed=5)
    res = full.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=False)
    assert not res.unexpected_keys and set(res.missing_keys) <= {"gpt.lm_head.weight"}
    got = _whole_by_global_id(full)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


def test_zero3_experts_cut_over_expert_data_groups_reshard(tmp_path) -> None:
    """World 4, ep=2, ZeRO-3: each expert is cut over its expert-data group of two; the checkpoint resumes
    bitwise at the same layout and loads at world 2 (ep=2, experts whole; ep=1, cut over both ranks)."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save, 4, path, 2, 3, timeout=180)
    want = _merged(saved)
    resumed = run_distributed(_load, 4, path, 2, 3, timeout=180)
    assert [c for _, c in resumed] == [c for _, c in saved]  # bitwise
    for ep in (2, 1):
        got = _merged(run_distributed(_load_only, 2, path, ep, 3, timeout=120))
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


def _frozen(path: str, ep: int, stage: int, save: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    engine, model = _engine(ep, stage, seed=0 if save else 5, frozen=True)
    if save:
        _steps(engine, 0, 2)
        engine.save_checkpoint(path, tag="t")
    else:
        engine.load_checkpoint(path, tag="t")
    return _by_global_id(model), _steps(engine, 2, 2)


@pytest.mark.parametrize("stage", [0, 3])
def test_frozen_experts_are_saved_by_every_expert_parallel_rank(tmp_path, stage: int) -> None:
    """Frozen experts differ per expert-parallel rank: each expert-data group's first rank writes its own,
    so an ep 2 checkpoint (world 4: expert-data groups [0,2] [1,3]) loads at ep 2 bitwise and at ep 1."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_frozen, 4, path, 2, stage, True, timeout=180)
    want = _merged(saved)
    assert sum(k.startswith("L1.E") for k in want) == 4 * 4
    fresh = MoEGPT(1, 1, 0, seed=0)  # the frozen experts still hold their initial values
    for gid in range(4):
        for n, p in fresh.expert(1, gid).named_parameters():
            torch.testing.assert_close(want[f"L1.E{gid}.{n}"], p.detach(), rtol=0, atol=0)
    resumed = run_distributed(_frozen, 4, path, 2, stage, False, timeout=180)
    assert [c for _, c in resumed] == [c for _, c in saved]
    for ep in (2, 1):
        got = _merged(run_distributed(_frozen, 2, path, ep, stage, False, timeout=120))
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)
    from safetensors.torch import load_file

    from zerospeed.runtime.checkpoint.consolidate import consolidate

    full = load_file(consolidate(path, str(tmp_path / "full.safetensors"), tag="t")["path"])
    for gid in range(4):
        for n, p in fresh.expert(1, gid).named_parameters():
            key = f"gpt.blocks.1.mlp.moe.deepspeed_moe.experts.deepspeed_experts.{gid}.{n}"
            torch.testing.assert_close(full[key], p.detach(), rtol=0, atol=0)
