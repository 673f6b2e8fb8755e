"""Pipeline checkpoints: save at pp=2 x dp=2 (ZeRO-1); resume there bitwise; load at pp=4 and pp=1; export."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import zerospeed
from zerospeed.testing import run_distributed

from .pipe_fixtures import batches, gpt_layers, gpt_pipe, rank_iter

MICRO, STEPS, SAVE_AT, GLOBAL = 2, 6, 3, 4  # GLOBAL micro-batches per step (gas x dp)


def _engine(pp: int, world: int):
    gas = GLOBAL // (world // pp)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 4}},
           "gradient_clipping": 0.5, "zero_optimization": {"stage": 1}}
    engine, *_ = zerospeed.initialize(model=gpt_pipe(pp), config=cfg)
    return engine, gas


def _params(engine) -> dict[str, torch.Tensor]:
    """This stage's parameters, without the copies of tied modules held for another stage (the unused
    ``wpe`` of the last stage's embedding copy only decays; the first stage's copy is the one saved)."""
    return {n: p.detach().clone() for n, p in engine.module.named_parameters() if id(p) not in engine.module.replicated
            or n.endswith("wte.weight")}


def _train_and_save(path: str) -> dict:
    engine, gas = _engine(2, 4)
    data = batches(STEPS, MICRO, GLOBAL)
    it = rank_iter(data, engine.grid.get_data_parallel_rank(), gas)
    losses = [float(engine.train_batch(it)) for _ in range(SAVE_AT)]
    engine.save_checkpoint(path, client_state={"note": "hi"})
    losses += [float(engine.train_batch(it)) for _ in range(STEPS - SAVE_AT)]
    return {"losses": losses, "params": _params(engine)}


def _resume(path: str, pp: int, world: int) -> dict:
    engine, gas = _engine(pp, world)
    ckpt, client = engine.load_checkpoint(path)
    data = batches(STEPS, MICRO, GLOBAL)[SAVE_AT:]
    it = rank_iter(data, engine.grid.get_data_parallel_rank(), gas)
    losses = [float(engine.train_batch(it)) for _ in range(STEPS - SAVE_AT)]
    return {"losses": losses, "params": _params(engine), "client": client, "steps": engine.global_steps,
            "lr": engine.get_lr()}


def test_pipeline_checkpoint_resumes_and_reshards(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_train_and_save, 4, path, timeout=120)
    assert sorted(os.listdir(os.path.join(path, "global_step3", "shards"))) == [f"rank_{r:05d}.safetensors"
                                                                               for r in range(4)]
    after = saved[0]["losses"][SAVE_AT:]
    same = run_distributed(_resume, 4, path, 2, 4, timeout=120)
    for before, now in zip(saved, same):  # same topology: bitwise
        assert now["losses"] == after and now["client"] == {"note": "hi"} and now["steps"] == STEPS
        assert all(torch.equal(before["params"][k], v) for k, v in now["params"].items())
    pp4 = run_distributed(_resume, 4, path, 4, 4, timeout=120)
    assert all(r["losses"] == pytest.approx(after, rel=1e-5) for r in pp4)
    pp1 = run_distributed(_resume, 1, path, 1, 1, timeout=120)[0]
    assert pp1["losses"] == pytest.approx(after, rel=1e-5) and pp1["lr"] == same[0]["lr"]
    # every layer of the pp=1 model equals the same layer trained at pp=2 x dp=2
    # (the key bias has a mathematically zero gradient: its float-noise gradient is normalised by Adam into
    # +-lr steps whose signs depend on summation order, so it is left out of the weight comparison)
    for r in saved:
        for k, v in r["params"].items():
            if k.endswith("qkv.bias"):
                continue
            assert torch.allclose(pp1["params"][k], v, rtol=1e-4, atol=1e-4), k  # Adam amplifies ~0 grads


def test_pipeline_checkpoint_exports_to_a_plain_model(tmp_path) -> None:
    from safetensors.torch import load_file
    from torch import nn

    from zerospeed.pipe import TiedLayerSpec
    from zerospeed.runtime.checkpoint.consolidate import consolidate

    path = str(tmp_path / "ckpt")
    saved = run_distributed(_train_and_save, 4, path, timeout=120)
    out = consolidate(path, str(tmp_path / "model.safetensors"), tag="global_step3")
    sd = load_file(out["path"])
    # a plain (non-pipeline) model of the same layers: keys are '<layer index>.<param>' and the tied module's
    plain = nn.ModuleDict()
    for i, spec in enumerate(gpt_layers()):
        if isinstance(spec, TiedLayerSpec):
            plain[f"tied_{spec.key}"] = plain[f"tied_{spec.key}"] if f"tied_{spec.key}" in plain else spec.build()
        else:
            plain[str(i)] = spec.build()
    renamed = {k.replace("tied_modules.", "tied_"): v for k, v in sd.items()}
    plain.load_state_dict(renamed, strict=True)
    assert len(sd) == sum(1 for _ in plain.state_dict())


def _async_save_then_resume(path: str) -> dict:
    """pp=2: save asynchronously after step SAVE_AT and keep training while it is written; a second engine
    loads it and must continue with bitwise the same losses."""
    engine, gas = _engine(2, 2)
    it = rank_iter(batches(STEPS, MICRO, GLOBAL), 0, gas)
    for _ in range(SAVE_AT):
        engine.train_batch(it)
    engine.save_checkpoint(path, client_state={"note": "async"}, async_save=True)
    after = [float(engine.train_batch(it)) for _ in range(STEPS - SAVE_AT)]  # updates params in place meanwhile
    engine.wait_for_checkpoint()
    resumed, _ = _engine(2, 2)
    _, client = resumed.load_checkpoint(path)
    it = rank_iter(batches(STEPS, MICRO, GLOBAL)[SAVE_AT:], 0, gas)
    again = [float(resumed.train_batch(it)) for _ in range(STEPS - SAVE_AT)]
    return {"after": after, "again": again, "client": client, "steps": resumed.global_steps}


def test_pipeline_async_save_resumes_bitwise(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    for r in run_distributed(_async_save_then_resume, 2, path, timeout=120):
        assert r["again"] == r["after"] and r["client"] == {"note": "async"} and r["steps"] == STEPS
    assert os.path.isdir(os.path.join(path, "global_step3"))


def _parallel_write(path: str) -> dict[str, Any]:
    """checkpoint.parallel_write.pipeline_stage: each stage writes its own frozen tensors into its shard file."""
    from zerospeed.runtime.checkpoint import consolidate, layout
    from zerospeed.runtime.checkpoint.tensor_file import TensorReader

    def build() -> Any:
        module = gpt_pipe(2)
        for name, p in module.named_parameters():
            if ".ln1." in name:
                p.requires_grad_(False)
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1},
               "checkpoint": {"parallel_write": {"pipeline_stage": True}}}
        return zerospeed.initialize(model=module, config=cfg)[0]

    engine = build()
    frozen = {n: p for n, p in engine.module.named_parameters() if not p.requires_grad}
    with torch.no_grad():
        for i, p in enumerate(frozen.values()):
            p.fill_(0.5 + i + 10 * engine.stage_id)
    engine.train_batch(rank_iter(batches(1, MICRO, 2), 0, 2))
    engine.save_checkpoint(path, tag="pw")
    ckpt = os.path.join(path, "pw")
    with TensorReader(os.path.join(ckpt, layout.shard_file(engine.global_rank))) as f:
        mine = sorted(k.removeprefix("module/") for k in f.keys() if k.startswith("module/"))
    with TensorReader(os.path.join(ckpt, layout.MODULE_FILE)) as f:
        rank0_module = list(f.keys())
    fresh = build()
    fresh.load_checkpoint(path, tag="pw")
    loaded = _params(fresh)
    same = all(torch.equal(p, loaded[n]) for n, p in _params(engine).items())
    exported = consolidate(path, os.path.join(path, f"export{engine.global_rank}.safetensors"), tag="pw")["path"]
    with TensorReader(exported) as f:
        in_export = {k: f.read(k) for k in mine}
    return {"mine": mine, "frozen": sorted(frozen), "rank0_module": rank0_module, "same": same,
            "export_ok": all(torch.equal(in_export[k], frozen[k].detach()) for k in mine)}


def test_parallel_write_has_each_stage_write_its_own_module_tensors(tmp_path) -> None:
    outs = run_distributed(_parallel_write, 2, str(tmp_path), timeout=180)
    for out in outs:
        assert out["mine"] and out["mine"] == out["frozen"]  # this stage's frozen tensors, in its own file
        assert out["rank0_module"] == [], out  # nothing gathered to rank 0
        assert out["same"], out  # a fresh engine loads them back
        assert out["export_ok"], out  # to-fp32 finds them
