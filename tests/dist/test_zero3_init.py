"""zero.Init builds a model already partitioned (peak parameter memory ~ 1/N of the model plus its largest
layer); GatheredParameters reads, and modifies on one rank with the change broadcast and re-partitioned."""

import pytest
import torch
from torch import nn

from zerospeed.testing import run_distributed

LAYERS, WIDTH = 6, 32


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.out = nn.Linear(WIDTH, 2)
        self.gain = nn.Parameter(torch.full((WIDTH * WIDTH,), 0.5))  # the root's own, cut at exit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x * self.gain[:WIDTH])


def _build() -> dict:
    from zerospeed import comm
    from zerospeed.zero import GatheredParameters, Init, ShardState, shard_of

    world = comm.get_world_size()
    torch.manual_seed(0)
    with Init(config_dict_or_path={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}) as init:
        model = Stack()
    states = [shard_of(p) for p in model.parameters()]
    assert all(s is not None and s.state is ShardState.SHARDED for s in states)
    local = sum(s.local_bytes() for s in states)
    full = sum(s.numel * 4 for s in states)
    largest = max(s.numel * 4 for s in states)
    torch.manual_seed(0)
    plain = Stack()
    with GatheredParameters(model.parameters()):
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
        shapes = [tuple(p.shape) for p in model.parameters()]
    return {"world": world, "local": local, "full": full, "largest": largest, "peak": init.peak_param_bytes,
            "same": same, "shapes_ok": shapes == [tuple(p.shape) for p in plain.parameters()],
            "empty_after": all(p.numel() == 0 for p in model.parameters())}


@pytest.mark.parametrize("world", [2, 4])
def test_init_builds_partitioned(world: int) -> None:
    for r in run_distributed(_build, world, timeout=60):
        assert r["same"] and r["shapes_ok"] and r["empty_after"]
        # Each rank keeps 1/N of the parameters (plus at most one element of padding per parameter and rank).
        assert r["local"] <= r["full"] / world + 4 * (LAYERS * 2 + 3)
        # While building, at most 1/N of the model plus the largest layer was whole.
        assert r["peak"] <= r["full"] / world + r["largest"] + 4 * (LAYERS * 2 + 3)
        assert r["peak"] < r["full"]


def _modify() -> dict:
    import zerospeed
    from zerospeed import comm
    from zerospeed.zero import GatheredParameters, full_state_dict

    rank = comm.get_rank()
    torch.manual_seed(0)
    model = Stack()
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, opt, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    w = model.layers[2].weight
    with GatheredParameters(w, modifier_rank=0):
        w.data.fill_(1.0 if rank == 0 else -7.0)  # only rank 0's change counts
        b = model.out.bias  # not gathered: still an empty placeholder
        outside = b.numel()
    with GatheredParameters([w]):
        seen = w.detach().clone()
    masters = full_state_dict(model, optimizer=opt, fp32=True, rank0_only=False)
    read = full_state_dict(model, rank0_only=False)
    return {"seen_ok": bool((seen == 1.0).all()), "master_ok": bool((masters["layers.2.weight"] == 1.0).all()),
            "read_ok": bool((read["layers.2.weight"] == 1.0).all()), "outside": outside}


def test_gathered_parameters_modify_and_broadcast() -> None:
    for r in run_distributed(_modify, 2, timeout=60):
        assert r["seen_ok"] and r["master_ok"] and r["read_ok"]
        assert r["outside"] == 0


def _save(path: str) -> dict:
    import zerospeed
    from zerospeed.config import ConfigError
    from zerospeed.zero import GatheredParameters

    torch.manual_seed(0)
    model = Stack()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero}
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    try:
        engine.save_16bit_model(path)
        refused = False
    except ConfigError as exc:
        refused = "stage3_gather_16bit_weights_on_model_save" in str(exc)
    engine.zero3.gather_16bit_on_save = True
    wrote = engine.save_16bit_model(path, "m.safetensors")
    with GatheredParameters(model.parameters()):
        expected = {k: v.clone() for k, v in model.state_dict().items()}
    return {"refused": refused, "wrote": wrote, "expected": expected}


def test_save_16bit_model(tmp_path) -> None:
    from safetensors.torch import load_file

    results = run_distributed(_save, 2, str(tmp_path), timeout=60)
    assert all(r["refused"] for r in results)
    assert [r["wrote"] for r in results] == [True, False]
    saved = load_file(str(tmp_path / "m.safetensors"))
    assert set(saved) == set(results[0]["expected"])
    for k, v in results[0]["expected"].items():
        assert saved[k].dtype == torch.bfloat16 and torch.equal(saved[k], v), k
