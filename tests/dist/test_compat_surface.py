"""The DeepSpeed surface scripts and frameworks call: tensor-fragment helpers, frozen-parameter exclusion,
destroy(), local_rank, the consolidated 16-bit state dict. Real ranks, Gloo."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.testing import run_distributed
from zerospeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_set_full_fp32_param,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _cfg(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 16, "allgather_bucket_size": 16,
                                  "stage3_param_persistence_threshold": 0}}


def _fragments(stage: int) -> dict:
    model = _model()
    engine, *_ = zerospeed.initialize(model=model, config=_cfg(stage))
    rank = zerospeed.comm.get_rank()
    torch.manual_seed(1 + rank)
    grads = {}
    for step in range(2):
        x = torch.randn(2, 5)
        engine.backward(engine(x).square().mean())
        if step == 1:
            grads = {n: safe_get_full_grad(p).clone() for n, p in model.named_parameters()}
        engine.step()
    out = {"fp32": {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()},
           "exp_avg": {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in model.named_parameters()},
           "local": {n: safe_get_local_fp32_param(p) for n, p in model.named_parameters()},
           "grads": grads}
    w = model[0].weight
    safe_set_full_fp32_param(w, torch.arange(35, dtype=torch.float32).view(7, 5))
    out["after_set"] = safe_get_full_fp32_param(w)
    if stage < 3:
        out["module_after_set"] = w.detach().clone()
    return out


@pytest.fixture(scope="module")
def by_stage() -> dict[int, list[dict]]:
    return {s: run_distributed(_fragments, 2, s) for s in (0, 1, 2, 3)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_fragments_equal_unpartitioned(by_stage: dict, stage: int) -> None:
    ref = by_stage[0][0]
    for r in by_stage[stage]:
        for kind in ("fp32", "exp_avg", "grads"):
            for name, t in ref[kind].items():
                torch.testing.assert_close(r[kind][name], t, rtol=1e-6, atol=1e-7, msg=f"{kind} {name}")


def test_local_fragments_tile_the_full_tensor(by_stage: dict) -> None:
    r0, r1 = by_stage[2]
    for name, full in r0["fp32"].items():
        joined = torch.cat([r0["local"][name].reshape(-1), r1["local"][name].reshape(-1)])
        torch.testing.assert_close(joined[: full.numel()], full.reshape(-1))
        assert r0["local"][name].numel() < full.numel() or full.numel() == 1


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_set_full_fp32_param(by_stage: dict, stage: int) -> None:
    want = torch.arange(35, dtype=torch.float32).view(7, 5)
    for r in by_stage[stage]:
        torch.testing.assert_close(r["after_set"], want)
        if stage < 3:
            torch.testing.assert_close(r["module_after_set"], want)


def test_frozen_parameter_has_no_fragment() -> None:
    p = nn.Parameter(torch.ones(3))
    assert safe_get_full_fp32_param(p) is None and safe_get_full_optimizer_state(p, "exp_avg") is None


# --- exclude_frozen_parameters ---------------------------------------------------------------------
def _frozen_model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    for p in m[0].parameters():
        p.requires_grad_(False)
    return m


def _train(engine: zerospeed.Engine, steps: int, seed: int) -> list[float]:
    torch.manual_seed(seed + zerospeed.comm.get_rank())
    losses = []
    for _ in range(steps):
        loss = engine(torch.randn(2, 6)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _exclude_frozen(path: str, stage: int) -> dict:
    cfg = _cfg(stage)
    model = _frozen_model()
    engine, *_ = zerospeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg)
    _train(engine, 2, 0)
    engine.save_checkpoint(path, tag="t", exclude_frozen_parameters=True)
    engine.save_16bit_model(path, "model16.safetensors", exclude_frozen_parameters=True) \
        if stage < 3 else None
    cont = _train(engine, 2, 5)
    fresh = _frozen_model()  # same frozen base (same seed): what a LoRA user reloads
    with torch.no_grad():
        fresh[2].weight.zero_()
    engine2, *_ = zerospeed.initialize(model=fresh, model_parameters=[p for p in fresh.parameters() if p.requires_grad],
                                       config=cfg)
    engine2.load_checkpoint(path, tag="t")
    return {"cont": cont, "resumed": _train(engine2, 2, 5)}


@pytest.mark.parametrize("stage", [1, 3])
def test_exclude_frozen_parameters_saves_only_trainable_and_resumes(tmp_path, stage: int) -> None:
    import json

    from safetensors import safe_open

    r0, r1 = run_distributed(_exclude_frozen, 2, str(tmp_path), stage)
    assert r0["resumed"] == pytest.approx(r0["cont"], rel=1e-6) and r1["resumed"] == pytest.approx(r1["cont"], rel=1e-6)
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    with safe_open(str(tmp_path / "t" / "model_states.safetensors"), "pt") as f:
        assert "0.weight" not in f.keys() and "0.bias" not in f.keys()
    assert meta["tensors"]["0.weight"]["source"] == "excluded"
    if stage < 3:
        with safe_open(str(tmp_path / "model16.safetensors"), "pt") as f:
            assert sorted(f.keys()) == ["2.bias", "2.weight"]


# --- destroy, local_rank, flags, consolidated state dict --------------------------------------------
def _surface() -> dict:
    parser = zerospeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args([])
    args.local_rank = -1
    args.deepspeed_config = None
    model = _model()
    cfg = dict(_cfg(3), bf16={"enabled": False})
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = zerospeed.initialize(args=args, model=model, config=cfg)
    _ = _train_linear(engine)
    sd = engine._zero3_consolidated_16bit_state_dict()
    out = {"args_local_rank": args.local_rank, "engine_local_rank": engine.local_rank,
           "env_local_rank": int(os.environ.get("LOCAL_RANK", "0")), "fp16": engine.fp16_enabled(),
           "bf16": engine.bfloat16_enabled(), "gather16": engine.zero_gather_16bit_weights_on_model_save(),
           "sd_keys": sorted(sd), "sd_w": sd.get("0.weight"), "config_stage": engine.config["zero_optimization"]["stage"]}
    engine.destroy()
    out["hooks_left"] = len(engine.optimizer.reducer.hooks)
    try:
        engine(torch.randn(2, 5))
        out["after_destroy"] = "ran"
    except RuntimeError as exc:
        out["after_destroy"] = str(exc)
    return out


def _train_linear(engine: zerospeed.Engine) -> float:
    loss = engine(torch.randn(2, 5)).square().mean()
    engine.backward(loss)
    engine.step()
    return float(loss)


def test_engine_surface() -> None:
    r0, r1 = run_distributed(_surface, 2)
    for r in (r0, r1):
        assert r["args_local_rank"] == r["engine_local_rank"] == r["env_local_rank"]
        assert (r["fp16"], r["bf16"], r["gather16"], r["config_stage"]) == (False, False, True, 3)
        assert r["hooks_left"] == 0 and "destroyed" in r["after_destroy"]
    assert r0["sd_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"] and r0["sd_w"].shape == (7, 5)
    assert r1["sd_keys"] == []


# --- PEFT / LoRA ------------------------------------------------------------------------------------
def _lora_model() -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0,
                                           fan_in_fan_out=True))


def _lora_run(path: str) -> dict:
    cfg = _cfg(2)
    model = _lora_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = zerospeed.initialize(model=model, model_parameters=trainable, config=cfg)

    def train(eng: zerospeed.Engine, seed: int) -> list[float]:
        g = torch.Generator().manual_seed(seed + zerospeed.comm.get_rank())
        out = []
        for _ in range(2):
            ids = torch.randint(0, 64, (2, 8), generator=g)
            loss = eng(input_ids=ids, labels=ids).loss
            eng.backward(loss)
            eng.step()
            out.append(float(loss))
        return out

    train(engine, 0)
    engine.save_checkpoint(path, tag="lora", exclude_frozen_parameters=True)
    cont = train(engine, 7)
    fresh = _lora_model()  # base weights from the same seed, as from_pretrained would give
    engine2, *_ = zerospeed.initialize(model=fresh, model_parameters=[p for p in fresh.parameters() if p.requires_grad],
                                       config=cfg)
    engine2.load_checkpoint(path, tag="lora")
    return {"cont": cont, "resumed": train(engine2, 7), "n_trainable": len(trainable)}


def test_peft_lora_saves_only_adapters_and_resumes(tmp_path) -> None:
    pytest.importorskip("peft")
    import json

    r0, r1 = run_distributed(_lora_run, 2, str(tmp_path))
    assert r0["resumed"] == pytest.approx(r0["cont"], rel=1e-6) and r1["resumed"] == pytest.approx(r1["cont"], rel=1e-6)
    meta = json.loads((tmp_path / "lora" / "meta.json").read_text())
    written = {k for k, e in meta["tensors"].items() if e["source"] != "excluded" and "alias_of" not in e}
    assert written and all("lora_" in k for k in written if meta["tensors"][k]["source"] == "master")
    assert sum(e["source"] == "master" for e in meta["tensors"].values()) == r0["n_trainable"]
    excluded = [k for k, e in meta["tensors"].items() if e["source"] == "excluded"]
    assert any("c_attn.base_layer.weight" in k for k in excluded) and any("wte" in k for k in excluded)
    size = (tmp_path / "lora" / "model_states.safetensors").stat().st_size
    assert size < 4096, f"the module file holds {size} bytes: frozen base weights were written"
