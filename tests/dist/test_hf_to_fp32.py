"""to-fp32 output of a Hugging Face model trained under ZeRO loads with ``from_pretrained`` exactly."""

import pytest
import torch

from zerospeed.testing import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB = 64


def _build() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _train_and_save(ckpt_dir: str, stage: int) -> dict[str, torch.Tensor]:
    import zerospeed
    from zerospeed.zero import full_state_dict

    model = _build()
    engine, *_ = zerospeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage}})
    for step in range(2):
        ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(ckpt_dir, tag="t")
    if stage == 3:
        return full_state_dict(model, engine.optimizer, fp32=True, rank0_only=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [2, 3])
def test_from_pretrained_loads_consolidated_weights(tmp_path, stage: int) -> None:
    from zerospeed.runtime.checkpoint import consolidate

    live = run_distributed(_train_and_save, 2, str(tmp_path / "ckpt"), stage, timeout=120)[0]
    out = tmp_path / "hf"
    out.mkdir()
    _build().config.save_pretrained(out)
    consolidate(str(tmp_path / "ckpt"), str(out), tag="t")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    state = loaded.state_dict()
    matched = [name for name in live if name in state]
    assert len(matched) >= len(state) - 1, (sorted(live), sorted(state))
    for name in matched:
        assert torch.equal(state[name], live[name].float()), name
    assert torch.equal(loaded.lm_head.weight, loaded.transformer.wte.weight)
