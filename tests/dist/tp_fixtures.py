"""Tensor-parallel parity fixtures: tiny GPT / GPT-2 / Llama (GQA), token batches, a one-process reference."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB, SEQ, LR = 64, 8, 1e-3


def make_model(kind: str, seed: int = 0) -> nn.Module:
    """A tiny model of ``kind`` (gpt, gpt2, llama) with no dropout; the same weights for the same seed."""
    torch.manual_seed(seed)
    if kind == "gpt":
        from zerospeed.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32), seed=seed)
    import transformers as tf

    if kind == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return tf.GPT2LMHeadModel(cfg)
    if kind == "llama":
        cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                             tie_word_embeddings=False)
        return tf.LlamaForCausalLM(cfg)
    raise ValueError(kind)


def loss_of(kind: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Next-token loss over ``SEQ`` positions (``x`` holds ``SEQ + 1`` tokens)."""
    if kind == "gpt":
        return model(x[:, :-1], x[:, 1:])[1]
    return model(input_ids=x[:, :-1], labels=x[:, :-1]).loss


def global_batch(step: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)


def reference(kind: str, steps: int, batch: int, clip: float) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process, plain PyTorch: losses, global grad norms, final weights."""
    model = make_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses, norms = [], []
    for step in range(steps):
        loss = loss_of(kind, model, global_batch(step, batch))
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip if clip > 0 else float("inf"))
        opt.step()
        losses.append(loss.item())
        norms.append(float(norm))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_config(tp: int, stage: int, mb: int, clip: float, extra: dict[str, Any] | None = None,
                  sp: bool = False) -> dict[str, Any]:
    cfg = {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "allgather_bucket_size": 700},
        "tensor_parallel": {"autotp_size": tp, "sequence_parallel": sp},
    }
    cfg.update(extra or {})
    return cfg


def engine_run(kind: str, tp: int, stage: int, steps: int, batch: int, clip: float,
               extra: dict[str, Any] | None = None, sp: bool = False) -> dict[str, Any]:
    """The same run through zerospeed with tensor parallelism: per-step global losses and grad norms."""
    import zerospeed
    from zerospeed import comm

    model = make_model(kind)
    dp = comm.get_world_size() // tp
    engine, _, _, _ = zerospeed.initialize(model=model, config=engine_config(tp, stage, batch // dp, clip, extra, sp))
    grid = engine.tensor_parallel.grid
    dp_rank = grid.get_data_parallel_rank()
    losses, norms = [], []
    for step in range(steps):
        x = global_batch(step, batch)
        mb = batch // dp
        loss = loss_of(kind, engine, x[dp_rank * mb:(dp_rank + 1) * mb])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().reshape(1).clone()
        comm.all_reduce(total, group=grid.get_data_parallel_group())
        losses.append(float(total) / dp)
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms, "rank": comm.get_rank(), "dp_rank": dp_rank,
            "tp_rank": grid.get_slice_parallel_rank(), "full": full_state(engine.module)}


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsplit weights (gathered over the tensor-parallel group), in the model's original layout."""
    from zerospeed.parallel.tensor.export import full_state_dict

    return {k: v.float().cpu() for k, v in full_state_dict(model).items()}
