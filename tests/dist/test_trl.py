"""TRL on top: `class ZeroSpeedSFTTrainer(ZeroSpeedTrainer, SFTTrainer)` fine-tunes a GPT-2 (from a config) at
ZeRO-3 on 2 ranks with TRL's single-process SFT losses. Skipped where TRL is not installed (it is not in the
test extra: it pulls `datasets`)."""

from __future__ import annotations

import pytest
import torch

from zerospeed.testing import run_distributed

pytest.importorskip("trl")
pytest.importorskip("datasets")


def _sft(root: str, world: int) -> list[float]:
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from zerospeed.integrations.transformers import ZeroSpeedTrainer

    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    vocab["<pad>"], vocab["<eos>"] = len(vocab), len(vocab) + 1
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(vocab), n_positions=64, n_embd=16, n_layer=2, n_head=2,
                                       resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, pad_token_id=vocab["<pad>"],
                                       eos_token_id=vocab["<eos>"], bos_token_id=vocab["<eos>"]))
    data = Dataset.from_dict({"text": [f"the number {i} is {'even' if i % 2 == 0 else 'odd'}" for i in range(32)]})
    args = SFTConfig(output_dir=root, per_device_train_batch_size=4 // world, max_steps=4, learning_rate=1e-3,
                     logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, max_length=32, seed=0,
                     train_sampling_strategy="sequential", disable_tqdm=True, dataloader_drop_last=True)
    if world == 1:
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    else:
        class ZeroSpeedSFTTrainer(ZeroSpeedTrainer, SFTTrainer):
            pass

        trainer = ZeroSpeedSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                                      zerospeed_config={"train_micro_batch_size_per_gpu": "auto",
                                                        "gradient_accumulation_steps": "auto",
                                                        "gradient_clipping": "auto", "zero_optimization": {"stage": 3}})
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trl_sft_trainer_on_zerospeed(tmp_path) -> None:
    (ref,) = run_distributed(_sft, 1, str(tmp_path / "ref"), 1, timeout=300)
    r0, _ = run_distributed(_sft, 2, str(tmp_path / "zs"), 2, timeout=300)
    # token-weighted losses: TRL averages over the tokens of both ranks' padded batches; 1e-4 covers the
    # float summation order of that average
    assert len(r0) == 4 and r0 == pytest.approx(ref, rel=1e-4)
