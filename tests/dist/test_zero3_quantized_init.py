"""``weight_quantization.quantized_initialization`` under ``zero.Init`` and ZeRO-3 (DeepSpeed 0.19.6's semantics):
every ``nn.Linear`` / ``nn.Embedding`` weight's partition is codes and scales from the moment it is built; its
bytes are what they take; the forward equals the hand-written DeepSpeed dequantization; at world 2 a few
training steps (biases and norms train, the quantized weights are frozen) and a greedy generation equal one
process doing the same; a weight written in ``GatheredParameters`` is quantized again; with parameter offload,
pretrained weights are encoded as they load and a checkpoint restores the quantized weights."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from zerospeed.testing import run_distributed

from ..unit.test_quantized_init import deepspeed_dequantized

VOCAB, WIDTH, BITS, GROUP = 32, 16, 4, 8
QUANT = {"num_bits": BITS, "group_size": GROUP, "group_dim": 1, "symmetric": False}


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(self.ln(h))


def _reference_logits(ids: torch.Tensor) -> torch.Tensor:
    """One process, no ZeRO: the same model with each weight replaced by DeepSpeed's dequantized one."""
    torch.manual_seed(0)
    ref = TinyLM()
    with torch.no_grad():
        for m in (ref.wte, ref.up, ref.down, ref.head):
            m.weight.copy_(deepspeed_dequantized(m.weight, BITS, GROUP, 1))
    return ref(ids)


def _run() -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm
    from zerospeed.zero import GatheredParameters, shard_of

    world, rank = comm.get_world_size(), comm.get_rank()
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4 // world, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "weight_quantization": {"quantized_initialization": QUANT}}
    torch.manual_seed(0)
    with zerospeed.zero.Init(config_dict_or_path=config) as init:
        model = TinyLM()
    quantized = [model.wte.weight, model.up.weight, model.down.weight, model.head.weight]
    shards = [shard_of(w) for w in quantized]
    packed = [s.codec.nbytes for s in shards]  # type: ignore[union-attr]
    expected = [w_numel // 2 + 2 * 4 * (w_numel // GROUP) for w_numel in (s.numel for s in shards)]
    shard_ok = all(s.local.dtype == torch.uint8 and s.local.numel() == math.ceil(p / world)  # type: ignore[union-attr]
                   for s, p in zip(shards, packed))
    frozen = not any(w.requires_grad for w in quantized)
    codes = sum(math.ceil(p / world) for p in packed)
    floats = sum(4 * math.ceil(s.numel / world) for s in map(shard_of, model.parameters())
                 if s is not None and s.codec is None)  # at world 1 zero.Init cuts only the quantized ones
    init_bytes = init.shard_bytes
    engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    kept = engine.zero3.param_bytes()  # cut fp32 shards are their optimizer master's slots (counted there)
    whole = sum(4 * s.numel for s in map(shard_of, model.parameters()) if s.persistent)  # world 1: kept whole
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))
    engine.eval()
    with torch.no_grad():
        logits0 = engine(ids)
    engine.train()
    losses = []
    part = slice(rank * (4 // world), (rank + 1) * (4 // world))
    for step in range(2):
        x = torch.randint(0, VOCAB, (4, 7), generator=torch.Generator().manual_seed(10 + step))
        logits = engine(x[part, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[part, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().reshape(1))
    mean = torch.cat(losses)
    if world > 1:
        comm.all_reduce(mean, op=comm.ReduceOp.SUM)
    engine.eval()
    tokens = ids[:, :2]
    with torch.no_grad():
        for _ in range(4):  # greedy generation
            tokens = torch.cat([tokens, engine(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
        new = torch.linspace(-1, 1, VOCAB * WIDTH).reshape(VOCAB, WIDTH)
        with GatheredParameters([model.wte.weight], modifier_rank=0):
            model.wte.weight.copy_(new)
        with GatheredParameters([model.wte.weight]):
            rewritten = model.wte.weight.detach().clone()
    return {"shard_ok": shard_ok, "packed": packed, "expected": expected, "frozen": frozen,
            "kept": kept, "kept_expected": codes + whole, "init_bytes": init_bytes, "init_expected": codes + floats,
            "logits0": logits0, "losses": (mean / world).tolist(), "tokens": tokens,
            "rewritten": rewritten, "rewritten_ref": deepspeed_dequantized(new, BITS, GROUP, 1)}


def test_quantized_initialization_zero3_world2_equals_one_process() -> None:
    one = run_distributed(_run, 1, timeout=120)[0]
    two = run_distributed(_run, 2, timeout=120)
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(one["logits0"], _reference_logits(ids), rtol=1e-5, atol=1e-5)
    for r in (one, *two):
        assert r["shard_ok"] and r["frozen"] and r["packed"] == r["expected"]
        assert r["init_bytes"] == r["init_expected"] and r["kept"] == r["kept_expected"]
        torch.testing.assert_close(r["rewritten"], r["rewritten_ref"], rtol=1e-6, atol=1e-6)
    for r in two:
        torch.testing.assert_close(r["logits0"], one["logits0"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["losses"], one["losses"], rtol=1e-5, atol=0)
        assert torch.equal(r["tokens"], one["tokens"])


def _offload_pretrained_checkpoint(path: str) -> dict[str, Any]:
    import zerospeed
    from zerospeed.zero import GatheredParameters
    from zerospeed.zero.stage3.pretrained import load_pretrained_shards

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_param": {"device": "cpu"}},
              "weight_quantization": {"quantized_initialization": QUANT}}

    def engine(seed: int, pretrained: bool) -> Any:
        torch.manual_seed(seed)
        with zerospeed.zero.Init(config_dict_or_path=config):
            model = TinyLM()
        if pretrained:
            load_pretrained_shards(model, f"{path}/model.safetensors")  # encoded as it is written
        return zerospeed.initialize(model=model, config=config)[0]

    first = engine(3, pretrained=True)
    with GatheredParameters([first.module.up.weight]):
        loaded = first.module.up.weight.detach().clone()
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    first.eval()
    with torch.no_grad():
        logits = first(ids)
    first.save_checkpoint(f"{path}/ckpt", tag="t")
    second = engine(7, pretrained=False)  # other weights: the checkpoint brings the quantized ones back
    second.load_checkpoint(f"{path}/ckpt", tag="t")
    second.eval()
    with torch.no_grad():
        again = second(ids)
    return {"loaded": loaded, "logits": logits, "again": again}


def test_quantized_initialization_offload_pretrained_and_checkpoint(tmp_path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ref = TinyLM()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "model.safetensors"))
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    for r in run_distributed(_offload_pretrained_checkpoint, 2, str(tmp_path), timeout=120):
        torch.testing.assert_close(r["loaded"], deepspeed_dequantized(ref.up.weight.detach(), BITS, GROUP, 1),
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["logits"], _reference_logits(ids[:2]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["again"], r["logits"], rtol=1e-6, atol=1e-6)
