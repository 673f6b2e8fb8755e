"""The Hugging Face Trainer through ZeroSpeedTrainer: a GPT-2 (from a config) fine-tunes with a DeepSpeed JSON
holding "auto" values at stages 2 and 3 on 2 ranks with the plain Trainer's one-process losses; save_model then
from_pretrained gives the trained weights; resuming from a checkpoint continues the same loss curve."""

from __future__ import annotations

import pytest
import torch

from zerospeed.testing import run_distributed

pytest.importorskip("transformers")

STEPS = 6
AUTO_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
}
# The Trainer's own optimizer (AdamW without decay on biases and norms) and schedule: comparable to plain Trainer
PARITY_CONFIG = {k: v for k, v in AUTO_CONFIG.items() if k not in ("optimizer", "scheduler")}


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


class _Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 64, (48, 12), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(root: str, micro: int, steps: int = STEPS, save: bool = False, accumulate: int = 1):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=root, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulate,
                             max_steps=steps, learning_rate=3e-3, weight_decay=0.01, warmup_steps=2,
                             lr_scheduler_type="linear", logging_steps=1, report_to=[], save_strategy="steps" if save
                             else "no", save_steps=3, seed=0, train_sampling_strategy="sequential",
                             dataloader_drop_last=True, use_cpu=True, disable_tqdm=True, max_grad_norm=1.0)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _plain(root: str, accumulate: int) -> list[float]:
    from transformers import Trainer

    trainer = Trainer(model=_model(), args=_args(root, 4 // accumulate, accumulate=accumulate), train_dataset=_Data())
    trainer.train()
    return _losses(trainer)


def _zs(root: str, stage: int, accumulate: int, config: dict) -> dict:
    from zerospeed.integrations.transformers import ZeroSpeedTrainer

    cfg = dict(config, zero_optimization=dict(config["zero_optimization"], stage=stage))
    model = _model()
    trainer = ZeroSpeedTrainer(model=model, args=_args(root, 2 // accumulate, accumulate=accumulate),
                               train_dataset=_Data(), zerospeed_config=cfg)
    trainer.train()
    trainer.save_model(root + "/final")
    out = {"losses": _losses(trainer), "stage": trainer.engine.zero_optimization_stage(),
           "micro": trainer.engine.train_micro_batch_size_per_gpu(), "clip": trainer.engine.gradient_clipping()}
    if zerospeed_rank() == 0:
        from transformers import GPT2LMHeadModel

        loaded = GPT2LMHeadModel.from_pretrained(root + "/final")
        out["loaded_wte"] = loaded.transformer.wte.weight.detach().clone()
        out["loaded_ln"] = loaded.transformer.ln_f.weight.detach().clone()
    return out


def zerospeed_rank() -> int:
    import zerospeed

    return zerospeed.comm.get_rank()


def _plain_final_weights(root: str) -> dict:
    from transformers import Trainer

    trainer = Trainer(model=_model(), args=_args(root, 4), train_dataset=_Data())
    trainer.train()
    return {"wte": trainer.model.transformer.wte.weight.detach().clone(),
            "ln": trainer.model.transformer.ln_f.weight.detach().clone()}


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_losses_and_save_model(tmp_path, stage: int) -> None:
    (ref,) = run_distributed(_plain_final_weights, 1, str(tmp_path / "ref"), timeout=120)
    (ref_losses,) = run_distributed(_plain, 1, str(tmp_path / "ref2"), 1, timeout=120)
    r0, r1 = run_distributed(_zs, 2, str(tmp_path / "zs"), stage, 1, PARITY_CONFIG, timeout=180)
    assert (r0["stage"], r0["micro"], r0["clip"]) == (stage, 2, 1.0)  # "auto" resolved from TrainingArguments
    assert len(r0["losses"]) == STEPS and r0["losses"] == pytest.approx(ref_losses, rel=1e-5)
    torch.testing.assert_close(r0["loaded_wte"], ref["wte"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r0["loaded_ln"], ref["ln"], rtol=1e-5, atol=1e-6)


def test_trainer_with_accumulation(tmp_path) -> None:
    (ref,) = run_distributed(_plain, 1, str(tmp_path / "ref"), 2, timeout=120)
    r0, _ = run_distributed(_zs, 2, str(tmp_path / "zs"), 2, 2, PARITY_CONFIG, timeout=180)
    assert r0["losses"] == pytest.approx(ref, rel=1e-5)


def _resume(root: str, stage: int) -> dict:
    from zerospeed.integrations.transformers import ZeroSpeedTrainer

    cfg = dict(AUTO_CONFIG, zero_optimization=dict(AUTO_CONFIG["zero_optimization"], stage=stage))
    full = ZeroSpeedTrainer(model=_model(), args=_args(root + "/full", 2, save=True), train_dataset=_Data(),
                            zerospeed_config=cfg)
    full.train()
    again = ZeroSpeedTrainer(model=_model(), args=_args(root + "/full", 2), train_dataset=_Data(), zerospeed_config=cfg)
    again.train(resume_from_checkpoint=root + "/full/checkpoint-3")
    return {"full": _losses(full), "resumed": _losses(again)}


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_resume(tmp_path, stage: int) -> None:
    r0, _ = run_distributed(_resume, 2, str(tmp_path), stage, timeout=180)
    # the resumed Trainer's history starts with the checkpoint's (steps 1-3), then its own steps 4-6
    assert len(r0["resumed"]) == STEPS and r0["resumed"] == pytest.approx(r0["full"], rel=1e-5)


def _resolve_cases() -> dict:
    from transformers import TrainingArguments

    from zerospeed.integrations.transformers import resolve_auto_config

    args = TrainingArguments(output_dir="/tmp/x", per_device_train_batch_size=3, gradient_accumulation_steps=2,
                             learning_rate=1e-3, warmup_steps=10, max_grad_norm=0.5, use_cpu=True, report_to=[])
    out: dict = {"cfg": resolve_auto_config(AUTO_CONFIG, args, _model(), 100)}
    for name, bad in (("clip", dict(AUTO_CONFIG, gradient_clipping=2.0)),
                      ("left", dict(AUTO_CONFIG, fp16={"enabled": False, "loss_scale": "auto"}))):
        try:
            resolve_auto_config(bad, args, _model(), 100)
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def test_auto_values_and_mismatch() -> None:
    """In a child process: TrainingArguments sets up Accelerate's process-wide state."""
    (r,) = run_distributed(_resolve_cases, 1, timeout=120)
    cfg = r["cfg"]
    assert cfg["train_micro_batch_size_per_gpu"] == 3 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["gradient_clipping"] == 0.5 and cfg["optimizer"]["params"]["lr"] == 1e-3
    assert cfg["scheduler"]["params"]["total_num_steps"] == 100 and cfg["scheduler"]["params"]["warmup_num_steps"] == 10
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 16 * 16
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 160
    assert "gradient_clipping=2.0 vs TrainingArguments max_grad_norm=0.5" in r["clip"]
    assert "still 'auto'" in r["left"] and "fp16.loss_scale" in r["left"]
