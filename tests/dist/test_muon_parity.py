"""Muon (DeepSpeed's MuonWithAuxAdam from the config) under ZeRO 0-3 equals single-process Muon.

A tiny GPT (token and position embeddings, attention and MLP matrices, layer norms, biases, an untied
``lm_head``) trains a few steps with gradient accumulation and clipping. Its matrices go to Muon, the rest to
the auxiliary Adam (DeepSpeed's rule). Under ZeRO 1-3 every matrix is cut across both ranks, so Newton-Schulz
of a shard (what shard-local Muon would do) fails these comparisons; the owner-rank exchange makes it exact.
Checkpoints saved under one stage/world load under another and training continues as if uninterrupted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from zerospeed.testing import run_distributed

VOCAB, SEQ, D, LAYERS = 24, 6, 12, 2
STEPS, MB, GLOBAL_MICRO, CLIP = 4, 2, 4, 1.0  # gas = GLOBAL_MICRO // world: the global batch is fixed
PARAMS = {"muon_lr": 0.02, "adam_lr": 3e-3, "momentum": 0.9, "weight_decay": 0.05, "betas": [0.9, 0.95]}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D)  # a key bias gets a ~0 gradient: noise
        self.fc, self.out = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att)
        return x + self.out(torch.tanh(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.embed_positions = nn.Parameter(torch.randn(SEQ, D) * 0.1)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) + self.embed_positions
        for b in self.blocks:
            h = b(h)
        return nn.functional.cross_entropy(self.lm_head(self.ln_f(h)).flatten(0, 1), y.flatten())


def make_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def reference(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the global batch, MuonWithAuxAdam over DeepSpeed's Muon/Adam split, clipping."""
    from zerospeed.optim.muon import MuonWithAuxAdam
    from zerospeed.optim.muon_groups import parse_muon_params, split_muon_groups, tag_use_muon

    model = make_model()
    tag_use_muon(model)
    opt = MuonWithAuxAdam(split_muon_groups([{"params": list(model.parameters())}], PARAMS),
                          adam_w_mode=parse_muon_params(PARAMS).adam_w_mode)
    losses = []
    for step in range(steps):
        x, y = batch(step, MB * GLOBAL_MICRO)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def build(stage: int, extra: dict[str, Any] | None = None) -> Any:
    import zerospeed
    from zerospeed import comm

    config = {
        "train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GLOBAL_MICRO // comm.get_world_size(),
        "gradient_clipping": CLIP,
        "optimizer": {"type": "Muon", "params": PARAMS},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 400,
                              "stage3_param_persistence_threshold": 20},
        "steps_per_print": 1000, **(extra or {}),
    }
    engine, _, _, _ = zerospeed.initialize(model=make_model(), config=config)
    return engine


def train(engine: Any, first: int, steps: int) -> list[float]:
    from zerospeed import comm

    world, rank, gas = comm.get_world_size(), comm.get_rank(), GLOBAL_MICRO // comm.get_world_size()
    losses = []
    for step in range(first, first + steps):
        x, y = batch(step, MB * GLOBAL_MICRO)
        x, y, total = x.to(engine.device), y.to(engine.device), torch.zeros((), device=engine.device)
        for m in range(gas):
            lo = (m * world + rank) * MB
            loss = engine(x[lo:lo + MB], y[lo:lo + MB])
            engine.backward(loss)
            engine.step()
            total += loss.detach() / gas
        comm.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def full_state(engine: Any) -> dict[str, torch.Tensor]:
    from zerospeed.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def run(stage: int) -> dict[str, Any]:
    engine = build(stage)
    groups = [(g["name"], g["use_muon"], len(g["params"])) for g in engine.optimizer.param_groups]
    return {"losses": train(engine, 0, STEPS), "state": full_state(engine), "groups": groups}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_muon_parity(stage: int) -> None:
    ref_losses, ref_state = reference()
    for r in run_distributed(run, 2, stage, timeout=120):
        # qkv, proj, fc, out of each block to Muon; embeddings (one a 2-D nn.Parameter), head, norms, biases to Adam
        assert r["groups"] == [("muon-params", True, 4 * LAYERS), ("adam-params", False, 7 * LAYERS + 5)]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6, msg=f"parameter {k}")


def _save(stage: int, path: str) -> list[float]:
    engine = build(stage)
    head = train(engine, 0, 2)
    engine.save_checkpoint(path, tag="mid")
    return head + train(engine, 2, 2)


def _load(stage: int, path: str) -> list[float]:
    engine = build(stage, {"checkpoint": {"load_universal": True}})
    engine.load_checkpoint(path)
    return train(engine, 2, 2)


@pytest.mark.parametrize(("save_stage", "load_world", "load_stage"), [(2, 2, 3), (3, 1, 0)])
def test_muon_checkpoint_reshard(save_stage: int, load_world: int, load_stage: int, tmp_path: Any) -> None:
    """Momentum and Adam state survive save/load across stages and world sizes (the continued losses match)."""
    full = run_distributed(_save, 2, save_stage, str(tmp_path), timeout=120)[0]
    for tail in run_distributed(_load, load_world, load_stage, str(tmp_path), timeout=120):
        torch.testing.assert_close(torch.tensor(tail), torch.tensor(full[2:]), rtol=1e-5, atol=1e-6)


def _run_offload(stage: int) -> dict[str, Any]:
    engine = build(stage, {"zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                                                 "offload_optimizer": {"device": "cpu"}}})
    out = {"losses": train(engine, 0, STEPS), "state": full_state(engine)}
    engine.optimizer.stepper.close()
    return out


def _run_client(stage: int) -> dict[str, Any]:
    """A client ``MuonWithAuxAdam`` (groups tagged by the user) is exchanged under ZeRO just the same."""
    import zerospeed
    from zerospeed import comm
    from zerospeed.optim.muon import MuonWithAuxAdam
    from zerospeed.optim.muon_groups import split_muon_groups, tag_use_muon

    model = make_model()
    tag_use_muon(model)
    opt = MuonWithAuxAdam(split_muon_groups([{"params": list(model.parameters())}], PARAMS))
    config = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GLOBAL_MICRO // comm.get_world_size(),
              "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    engine, _, _, _ = zerospeed.initialize(model=model, optimizer=opt, config=config)
    return {"losses": train(engine, 0, STEPS), "state": full_state(engine)}


@pytest.mark.parametrize(("fn", "stage"), [(_run_offload, 2), (_run_client, 3)])
def test_muon_parity_offload_and_client(fn: Any, stage: int) -> None:
    ref_losses, ref_state = reference()
    for r in run_distributed(fn, 2, stage, timeout=120):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6, msg=f"parameter {k}")


def _vector_in_muon_group() -> None:
    import zerospeed
    from zerospeed.optim.muon import Muon

    model = make_model()
    opt = Muon(model.parameters())  # biases and norms too: Muon cannot orthogonalise them
    config = {"train_micro_batch_size_per_gpu": MB, "zero_optimization": {"stage": 2}}
    engine, _, _, _ = zerospeed.initialize(model=model, optimizer=opt, config=config)
    x, y = batch(0, MB)
    engine.backward(engine(x, y))
    engine.step()


def test_vector_in_a_muon_group_fails_on_every_rank() -> None:
    with pytest.raises(Exception, match="ndim >= 2") as info:
        run_distributed(_vector_in_muon_group, 2, timeout=60)
    assert "timed out" not in str(info.value).lower()


def _with_autotp() -> None:
    import zerospeed

    from .tp_fixtures import engine_config, make_model as tp_model

    config = engine_config(2, 1, 2, 0.0, {"optimizer": {"type": "Muon", "params": {}}})
    zerospeed.initialize(model=tp_model("gpt"), config=config)


def test_muon_with_tensor_parallelism_is_not_supported_yet() -> None:
    """A tensor-parallel shard of a matrix is not the matrix: orthogonalising it would be wrong, so it is refused."""
    with pytest.raises(Exception, match="Muon with tensor parallelism"):
        run_distributed(_with_autotp, 2, timeout=60)
