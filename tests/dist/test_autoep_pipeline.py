"""AutoEP inside a PipelineModule: stages made of Hugging Face Mixtral MoE blocks (found by structure, experts
sliced at initialize), pp 2 x dp 2 at world 4 with ep 2 inside each stage's data-parallel pair (ZeRO-1), equal to
one plain process running the unsplit HF blocks in sequence (rtol 1e-5, fp32). The load-balancing loss is left
out: inside a pipeline it is the user's layers that would carry it (test_moe_pipeline does, for MoE layers)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

import zerospeed
from zerospeed import comm
from zerospeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from zerospeed.testing import run_distributed

from .moe_fixtures import CFG, NUM_EXPERTS
from .test_moe_pipeline import CLIP, LR, MICRO, SEED, STEPS, EmbedAux, Norm, _data, _reference, head, loss_fn

EP = 2


class HFMoE(nn.Module):
    """A pre-norm residual around HF's ``MixtralSparseMoeBlock`` (4 experts, top-2), passing the aux sum on."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(CFG.n_embd)
        self.mlp = MixtralSparseMoeBlock(MixtralConfig(hidden_size=CFG.n_embd, intermediate_size=12,
                                                       num_local_experts=NUM_EXPERTS, num_experts_per_tok=2))
        with torch.no_grad():  # HF leaves these to PreTrainedModel's init; routers wide: no near-ties in top-2
            for name, p in self.mlp.named_parameters():
                p.normal_(0.0, 0.5 if name.startswith("gate") else 0.2)

    def forward(self, inp: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, aux = inp
        return x + self.mlp(self.norm(x)), aux


def _layers() -> list[Any]:
    tie = dict(tied_weight_attr=["wte.weight"])
    return [TiedLayerSpec("embed", EmbedAux, CFG.vocab_size, CFG.block_size, CFG.n_embd, **tie),
            *[LayerSpec(HFMoE) for _ in range(3)], LayerSpec(Norm, CFG.n_embd),
            TiedLayerSpec("embed", EmbedAux, CFG.vocab_size, CFG.block_size, CFG.n_embd, forward_fn=head, **tie)]


def _train(gas: int) -> dict:
    model = PipelineModule(_layers(), num_stages=2, loss_fn=loss_fn, seed_layers=True, base_seed=SEED,
                           partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": CLIP,
           "zero_optimization": {"stage": 1}, "expert_parallel": {"enabled": True, "autoep_size": EP}}
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    experts = [m for m in engine.module.modules() if type(m).__name__ == "AutoEPExperts"]
    dp, me = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
    data = _data(gas * dp)
    it = ((data[s, me * gas + j][:, :-1], data[s, me * gas + j][:, 1:]) for s in range(STEPS) for j in range(gas))
    losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
    return {"losses": losses, "experts": [e.gate_up_proj.shape[0] for e in experts],
            "first": experts[0].global_expert_ids()[0], "dp_rank": me, "stage": engine.grid.get_stage_id(),
            "rank": comm.get_rank()}


def test_autoep_in_a_pipeline_matches_one_process() -> None:
    gas = 2
    results = run_distributed(_train, 4, gas, timeout=180)
    expected = _reference(gas * 2, _layers())
    for r in results:
        assert r["losses"] == pytest.approx(expected, rel=1e-5), r
        assert r["experts"] and set(r["experts"]) == {NUM_EXPERTS // EP} and r["first"] == r["dp_rank"] % EP * (NUM_EXPERTS // EP), r
    assert {r["stage"] for r in results} == {0, 1}
