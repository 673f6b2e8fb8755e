"""With `zerospeed alias install`, the frameworks' own DeepSpeed code paths reach zerospeed (issue 29 part B):
the plain HF Trainer with TrainingArguments(deepspeed=cfg) at ZeRO-3, from_pretrained under zero.Init, save,
resume and reload; each matches the one-process reference within rtol 1e-5 (world 2, Gloo).

The alias is installed into a temporary site directory (never the shared environment) that each forked rank
puts first on sys.path; framework modules the parent already imported without it are dropped in the rank so
that their DeepSpeed detection runs again."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

import pytest
import torch

from zerospeed import deepspeed_alias
from zerospeed.testing import run_distributed

pytest.importorskip("transformers")

from .test_hf_trainer import PARITY_CONFIG, _args, _Data, _losses, _model  # noqa: E402

DETECTING = ("transformers.integrations.deepspeed", "transformers.modeling_utils", "accelerate.accelerator",
             "lightning.pytorch.strategies.deepspeed", "lightning.fabric.strategies.deepspeed")
STEPS = 4  # saved at step 3 (test_hf_trainer's save_steps), resumed for the last step
FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning", "lightning_fabric", "deepspeed")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("alias-site")
    deepspeed_alias.install(path)
    return str(path)


def use_alias(site: str) -> None:
    """In a forked rank: `import deepspeed` resolves through the alias in ``site``, detection starts afresh."""
    sys.path.insert(0, site)
    if any(m in sys.modules for m in DETECTING):  # decided "no deepspeed" in the parent: import them again
        for name in [n for n in sys.modules if n.split(".")[0] in FRAMEWORKS]:
            del sys.modules[name]
    importlib.invalidate_caches()


def _reference(root: str) -> dict:
    from transformers import Trainer

    trainer = Trainer(model=_model(), args=_args(root, 4, steps=STEPS), train_dataset=_Data())
    trainer.train()
    return {"losses": _losses(trainer), "wte": trainer.model.transformer.wte.weight.detach().clone()}


def _training_args(root: str, cfg: dict, save: bool = False):
    from transformers import TrainingArguments

    base = _args(root, 2, steps=STEPS, save=save)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(TrainingArguments) if f.init}
    return TrainingArguments(**{**fields, "deepspeed": cfg})


def _hf_zero3(site: str, root: str) -> dict:
    use_alias(site)
    import deepspeed  # noqa: F401 - what transformers finds
    from transformers import GPT2LMHeadModel, Trainer
    from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    import zerospeed

    if zerospeed.comm.get_rank() == 0:
        _model().save_pretrained(root + "/init")
    zerospeed.comm.barrier()
    cfg = dict(PARITY_CONFIG, zero_optimization=dict(PARITY_CONFIG["zero_optimization"], stage=3,
                                                     stage3_gather_16bit_weights_on_model_save=True,
                                                     stage3_param_persistence_threshold=0))
    args = _training_args(root + "/run", cfg, save=True)
    out: dict = {"zero3": is_deepspeed_zero3_enabled()}
    model = GPT2LMHeadModel.from_pretrained(root + "/init")  # under zero.Init: built partitioned
    out["partitioned"] = all(zerospeed.zero.stage3.shard_of(p) is not None for p in model.parameters())
    trainer = Trainer(model=model, args=args, train_dataset=_Data())
    trainer.train()
    out["engine"] = type(trainer.model_wrapped).__name__
    out["losses"] = _losses(trainer)
    trainer.save_model(root + "/final")
    again = Trainer(model=GPT2LMHeadModel.from_pretrained(root + "/init"), args=_training_args(root + "/run", cfg),
                    train_dataset=_Data())
    again.train(resume_from_checkpoint=root + "/run/checkpoint-3")
    out["resumed"] = _losses(again)
    unset_hf_deepspeed_config()  # no ZeRO-3 any more: a plain from_pretrained of what save_model wrote
    if zerospeed.comm.get_rank() == 0:
        out["loaded"] = GPT2LMHeadModel.from_pretrained(root + "/final").transformer.wte.weight.detach().clone()
    return out


def test_hf_trainer_deepspeed_argument_zero3(site: str, tmp_path: Path) -> None:
    (ref,) = run_distributed(_reference, 1, str(tmp_path / "ref"), timeout=120)
    r0, r1 = run_distributed(_hf_zero3, 2, site, str(tmp_path / "zs"), timeout=240)
    assert r0["zero3"] and r0["partitioned"] and r0["engine"] == "Engine"
    assert len(r0["losses"]) == STEPS and r0["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert r0["resumed"] == pytest.approx(r0["losses"], rel=1e-5) and r1["losses"] == r0["losses"]
    torch.testing.assert_close(r0["loaded"], ref["wte"], rtol=1e-5, atol=1e-6)


def _tiny_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(24, 8, generator=g), torch.randn(24, 1, generator=g)


def _tiny_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _tiny_reference(batch: int) -> list[float]:
    model, (x, y) = _tiny_net(), _tiny_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i in range(len(x) // batch):
        loss = torch.nn.functional.mse_loss(model(x[i * batch:(i + 1) * batch]), y[i * batch:(i + 1) * batch])
        losses.append(loss.item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return losses


def _accelerate_zero2(site: str, config_file: str) -> dict:
    """What `accelerate launch --use_deepspeed --deepspeed_config_file ds.json` sets up in each rank."""
    import os

    use_alias(site)
    import zerospeed

    rank, world = zerospeed.comm.get_rank(), zerospeed.comm.get_world_size()
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "ACCELERATE_USE_DEEPSPEED": "true",
                       "ACCELERATE_DEEPSPEED_CONFIG_FILE": config_file, "ACCELERATE_MIXED_PRECISION": "no"})
    from accelerate import Accelerator

    accelerator = Accelerator()
    model, (x, y) = _tiny_net(), _tiny_data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    model, opt, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loader)
    losses = []
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        losses.append(loss.item())
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "engine": type(model).__name__, "stage": model.zero_optimization_stage(),
            "processes": accelerator.num_processes}


def test_accelerate_deepspeed_plugin_zero2(site: str, tmp_path: Path) -> None:
    import json

    pytest.importorskip("accelerate")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                                  "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}}))
    r0, r1 = run_distributed(_accelerate_zero2, 2, site, str(config), timeout=180)
    assert (r0["engine"], r0["stage"]) == ("Engine", 2)
    # Without a GPU Accelerate picks no process-group backend and counts one process, so it shards no batches:
    # both ranks train on the same micro-batches, whose averaged gradient is the one-process gradient.
    assert r0["processes"] == 1
    assert r0["losses"] == pytest.approx(_tiny_reference(4), rel=1e-5) and r1["losses"] == r0["losses"]


def _lightning_deepspeed_stage_3(site: str) -> dict:
    use_alias(site)
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy

    out: dict = {}
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="deepspeed_stage_3", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    strategy = trainer.strategy
    out["strategy"] = (type(strategy).__name__, isinstance(strategy, DeepSpeedStrategy),
                       strategy.config["zero_optimization"]["stage"])
    try:
        strategy.setup_environment()
    except RuntimeError as exc:
        out["cpu"] = str(exc)
    return out


def test_lightning_deepspeed_stage_3_detects_zerospeed(site: str) -> None:
    """Lightning finds DeepSpeed (its import and version checks pass) and builds its own stage-3 strategy; its
    DeepSpeedStrategy then refuses a CPU accelerator by itself (as with the real DeepSpeed), which is why
    zerospeed's ZeroSpeedStrategy (tests/dist/test_lightning.py) is the CPU route."""
    pytest.importorskip("lightning")
    (r,) = run_distributed(_lightning_deepspeed_stage_3, 1, site, timeout=120)
    assert r["strategy"] == ("DeepSpeedStrategy", True, 3)
    assert "only supported on CUDA GPUs" in r["cpu"]
