"""Hugging Face models built from a config (no downloads) train under ZeRO stage 3 unchanged and match
one process (fp32, rtol 1e-5): GPT-2 (tied embeddings, Conv1D) and Llama (RMSNorm, rotary buffers)."""

import pytest
import torch

from zerospeed.testing import run_distributed

transformers = pytest.importorskip("transformers")

STEPS, MB, GAS, SEQ, VOCAB = 4, 2, 2, 8, 64


def _build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(cfg)


def _batch(step: int, size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(step))


def _reference(kind: str, world: int) -> list[float]:
    model = _build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        ids = _batch(step, MB * GAS * world)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def _train(kind: str) -> list[float]:
    import zerospeed
    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    model = _build(kind)
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 2000, "reduce_bucket_size": 4000}}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    for step in range(STEPS):
        ids = _batch(step, MB * GAS * world)
        total = torch.zeros(())
        for m in range(GAS):
            lo = (m * world + rank) * MB
            loss = engine(input_ids=ids[lo:lo + MB], labels=ids[lo:lo + MB]).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach() / GAS
        comm.all_reduce(total)
        losses.append(float(total) / world)
    return losses


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_model_parity(kind: str, world: int) -> None:
    ref = _reference(kind, world)
    for losses in run_distributed(_train, world, kind, timeout=180):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
