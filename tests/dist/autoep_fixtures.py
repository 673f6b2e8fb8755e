"""Tiny Hugging Face MoE models built from configs (no downloads) and a single-process reference for AutoEP."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,  # before the fork
                          DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM)

VOCAB, SEQ = 64, 8


def tiny_moe(family: str, seed: int = 0, **extra: Any) -> nn.Module:
    """A 2-layer Mixtral or Qwen2-MoE (4 experts, top-2) whose loss includes the load-balancing loss, or a
    DeepSeek-V2 / V3 (4 routed experts in 2 groups, 1 group chosen per token, a shared expert, routed scaling 1.5;
    HF's DeepSeek models have no auxiliary loss); ``extra`` overrides config fields."""
    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=2, max_position_embeddings=32, num_experts_per_tok=2,
                                  output_router_logits=True, router_aux_loss_coef=0.05, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=12, num_local_experts=4, **common, **extra))
    elif family.startswith("deepseek"):
        model = _tiny_deepseek(family, common, extra)
    else:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(moe_intermediate_size=12, shared_expert_intermediate_size=8,
                                                   num_experts=4, intermediate_size=12, norm_topk_prob=False,
                                                   **common, **extra))
    with torch.no_grad():  # routers spread wider than HF's init, so top-2 choices are not near-ties
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model.float()


def _tiny_deepseek(family: str, common: dict[str, Any], extra: dict[str, Any]) -> nn.Module:
    """Multi-head latent attention at its smallest; every layer MoE; V3's score-correction bias set (a buffer that
    only steers the choice of experts), so the test sees it."""
    kw = {k: v for k, v in common.items() if k not in ("output_router_logits", "router_aux_loss_coef")}
    kw.update(moe_intermediate_size=12, intermediate_size=12, n_routed_experts=4, n_shared_experts=1,
              first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
              v_head_dim=4, n_group=2, topk_group=1, routed_scaling_factor=1.5)
    if family == "deepseek_v2":
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**{"topk_method": "group_limited_greedy", **kw, **extra}))
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**{"norm_topk_prob": True, **kw, **extra}))
        g = torch.Generator().manual_seed(5)
        for layer in model.model.layers:
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(4, generator=g))
    return model


def batch(step: int, rank: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9000 + 31 * step + rank)
    ids = torch.randint(0, VOCAB, (mb, SEQ), generator=g)
    return ids, ids.clone()


def loss_of(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=labels).loss


def train_steps(engine: Any, steps: int, replica: int, mb: int, load: str = "") -> list[float]:
    """Resume from ``load`` (if given), then ``steps`` engine steps on ``replica``'s batches; the losses."""
    first = 0
    if load:
        engine.load_checkpoint(load)
        first = engine.global_steps
    losses = []
    for step in range(first, first + steps):
        loss = loss_of(engine, *batch(step, replica, mb))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def reference(family: str, steps: int, world: int, mb: int, lr: float, adam: bool = False,
              clip: float = 0.0, routing: dict[str, Any] | None = None) -> tuple[list, nn.Module]:
    """One process: each rank's micro-batch on its own (the aux loss is per rank, as there), losses averaged;
    ``clip`` > 0: the gradient's global norm clipped to it; ``routing``: AutoEP routing keys (applied at ep 1,
    where tests/unit/test_autoep.py checks them against HF and DeepSpeed's formulas)."""
    model = tiny_moe(family)
    if routing:
        from zerospeed.config.expert_parallel import ExpertParallelConfig
        from zerospeed.parallel.expert.auto import autoep_model

        autoep_model(ExpertParallelConfig(enabled=True, **routing), model)
    opt = torch.optim.Adam(model.parameters(), lr=lr) if adam else torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        per_rank = [loss_of(model, *batch(step, r, mb)) for r in range(world)]
        (sum(per_rank) / world).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append([float(x.detach()) for x in per_rank])
    return losses, model


def engine_config(stage: int, ep: int, mb: int, world: int, lr: float, adam: bool = False) -> dict[str, Any]:
    opt = {"type": "Adam", "params": {"lr": lr}} if adam else {"type": "SGD", "params": {"lr": lr}}
    zero3 = {"stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True} \
        if stage == 3 else {}
    return {"train_micro_batch_size_per_gpu": mb, "train_batch_size": mb * world, "gradient_clipping": 0.0,
            "optimizer": opt, "zero_optimization": {"stage": stage, **zero3},
            "expert_parallel": {"enabled": True, "autoep_size": ep}}


def local_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name (an AutoEP expert weight: this rank's experts only)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def check_state(state: dict[str, torch.Tensor], ref: nn.Module, first_expert: int, rtol: float = 1e-5,
                atol: float = 1e-6) -> None:
    for name, p in ref.named_parameters():
        want = p.detach()
        got = state[name]
        if got.shape != want.shape:  # this rank's experts only
            want = want[first_expert:first_expert + got.shape[0]]
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
