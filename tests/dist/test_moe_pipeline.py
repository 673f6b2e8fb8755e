"""MoE layers inside a PipelineModule: each stage's expert groups are cut inside its data-parallel group, expert
gradients reduced over expert-data-parallel groups, the load-balancing loss carried to the loss through the
activations (as Megatron-DeepSpeed's pipelined MoE does), and the result equal to one plain process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerospeed
from zerospeed import comm
from zerospeed.models.gpt import MLP, Block
from zerospeed.moe.layer import MoE
from zerospeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from zerospeed.testing import run_distributed

from .moe_fixtures import AUX, CFG, NUM_EXPERTS, MoEMLP, _init_layer
from .pipe_fixtures import Embed

SEED, STEPS, MICRO, LR, CLIP = 77, 6, 2, 0.5, 0.05


class EmbedAux(Embed):
    """The embedding, starting the (hidden, aux-loss sum) pair the layers pass on."""

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x = super().forward(ids)
        return x, x.new_zeros(())


def head(embed: Embed, inp: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    x, aux = inp
    return x @ embed.wte.weight.t(), aux


class MoEBlock(nn.Module):
    """A transformer block whose MLP is an MoE layer; adds ``AUX * l_aux`` to the carried sum."""

    def __init__(self, ep: int, ep_rank: int) -> None:
        super().__init__()
        seed = torch.initial_seed()  # the pipeline seeds each layer (seed_layers)
        self.block = Block(CFG)
        moe = MoE(CFG.n_embd, MLP(CFG), NUM_EXPERTS, ep, 1, capacity_factor=1.0, min_capacity=1, use_rts=False)
        self.block.mlp = MoEMLP(moe)
        _init_layer(moe, seed, ep_rank)

    def forward(self, inp: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, aux = inp
        y = self.block(x)
        return y, aux + AUX * self.block.mlp.l_aux


class Norm(nn.LayerNorm):
    def forward(self, inp: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return super().forward(inp[0]), inp[1]


def loss_fn(out: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    logits, aux = out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)) + aux


def layers(ep: int, ep_rank: int) -> list[Any]:
    tie = dict(tied_weight_attr=["wte.weight"])
    return [TiedLayerSpec("embed", EmbedAux, CFG.vocab_size, CFG.block_size, CFG.n_embd, **tie),
            *[LayerSpec(MoEBlock, ep, ep_rank) for _ in range(3)],
            LayerSpec(Norm, CFG.n_embd),
            TiedLayerSpec("embed", EmbedAux, CFG.vocab_size, CFG.block_size, CFG.n_embd, forward_fn=head, **tie)]


def _data(count: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, CFG.vocab_size, (STEPS, count, MICRO, CFG.block_size + 1), generator=g)


def _engine(pp: int, ep: int, stage: int, gas: int, seed: int = SEED) -> Any:
    rank, world = comm.get_rank(), comm.get_world_size()
    ep_rank = rank % (world // pp) % ep
    model = PipelineModule(layers(ep, ep_rank), num_stages=pp, loss_fn=loss_fn, seed_layers=True, base_seed=seed,
                           partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": CLIP,
           "zero_optimization": {"stage": stage}}
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    return engine


def _batches(engine: Any, gas: int, first: int, n: int):
    dp, me = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
    data = _data(gas * dp)
    return ((data[s, me * gas + j][:, :-1], data[s, me * gas + j][:, 1:]) for s in range(first, first + n)
            for j in range(gas))


def _checkpoint(path: str, ep: int, save: bool) -> list[float]:
    """Save after 2 steps and go on for 2 (``save``), or load that checkpoint into another model and go on."""
    engine = _engine(2, ep, 1, 1, seed=SEED if save else SEED + 1)
    if save:
        it = _batches(engine, 1, 0, 2)
        for _ in range(2):
            engine.train_batch(it)
        engine.save_checkpoint(path, tag="t")
    else:
        engine.load_checkpoint(path, tag="t")
    it = _batches(engine, 1, 2, 2)
    return [float(engine.train_batch(it)) for _ in range(2)]


def test_moe_pipeline_checkpoint_resumes_and_reshards_experts(tmp_path) -> None:
    """pp 2 x dp 2 at ep 2 (each rank holds half the experts of its stage): resumes bitwise at ep 2, and the
    experts saved by global id load at ep 1 (each rank holds them all) with the same continued losses."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_checkpoint, 4, path, 2, True, timeout=180)
    assert run_distributed(_checkpoint, 4, path, 2, False, timeout=180) == saved
    for got, want in zip(run_distributed(_checkpoint, 4, path, 1, False, timeout=180), saved):
        assert got == pytest.approx(want, rel=1e-5)


def _train(pp: int, ep: int, stage: int, gas: int) -> dict:
    engine = _engine(pp, ep, stage, gas)
    moes = [m for m in engine.module.modules() if isinstance(m, MoE)]
    assert moes, "every stage holds an MoE layer"
    groups = moes[0].expert_groups
    dp_ranks = sorted(engine.grid.get_data_parallel_group_ranks())
    assert set(groups.ep_ranks) <= set(dp_ranks) and set(groups.edp_ranks) <= set(dp_ranks)  # inside the stage
    # pipe-major grid: expert peers adjacent within the stage's data-parallel group
    assert moes[0].global_expert_ids()[0] == engine.grid.get_data_parallel_rank() % ep * (NUM_EXPERTS // ep)
    it = _batches(engine, gas, 0, STEPS)
    losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
    return {"losses": losses, "norm": engine.get_global_grad_norm(), "a2a": groups.ep_size > 1}


def _reference(count: int, specs: list[Any] | None = None) -> list[float]:
    """One process running the unsplit layers (``specs``; default this file's at ep 1) in sequence, each
    micro-batch on its own, SGD with clipping: what every pipelined run must equal."""
    modules: list[Any] = []
    tied: dict[str, nn.Module] = {}
    for idx, spec in enumerate(layers(1, 0) if specs is None else specs):
        torch.manual_seed(SEED + idx)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build()
            m = tied[spec.key]
            modules.append(m if spec.forward_fn is None else (lambda x, m=m, f=spec.forward_fn: f(m, x)))
        else:
            modules.append(spec.build())
    params = list(dict.fromkeys(p for m in modules if isinstance(m, nn.Module) for p in m.parameters()))
    opt = torch.optim.SGD(params, lr=LR)
    data = _data(count)
    out = []
    for s in range(STEPS):
        total = 0.0
        for j in range(count):  # each micro-batch routed on its own, as on its rank
            x: Any = data[s, j][:, :-1]
            for m in modules:
                x = m(x)
            loss = loss_fn(x, data[s, j][:, 1:])
            (loss / count).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
        out.append(total / count)
    return out


@pytest.mark.parametrize("world,pp,ep,stage,gas", [
    (2, 2, 1, 0, 2),   # pp 2: each stage's experts whole on its rank
    (4, 2, 2, 1, 2),   # pp 2 x dp 2, ep 2 inside each stage (all-to-all between the stage's two ranks), ZeRO-1
    (4, 2, 1, 1, 1),   # pp 2 x dp 2, ep 1: experts replicated over the stage's data-parallel pair, ZeRO-1
])
def test_moe_pipeline_matches_one_process(world: int, pp: int, ep: int, stage: int, gas: int) -> None:
    results = run_distributed(_train, world, pp, ep, stage, gas, timeout=180)
    expected = _reference(gas * world // pp)
    for r in results:
        assert r["losses"] == pytest.approx(expected, rel=1e-5)
        assert r["a2a"] == (ep > 1)
    assert len({round(r["norm"], 6) for r in results}) == 1  # one norm over stages, experts and shards
