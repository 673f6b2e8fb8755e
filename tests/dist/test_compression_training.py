"""``compression_training`` through the engine (issue 35): the engine steps the compression scheduler and MoQ;
ZeRO-2 and ZeRO-3 at world 2 train exactly as one process does (rtol 1e-5): QAT with learned row pruning, and
MoQ with its falling bits."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerospeed.testing import run_distributed

COMPRESSION = {  # MoQ (bits falling 6 -> 3), learned row pruning, dynamic 8-bit activations
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_groups": 4,
                              "fp16_mixed_quantize": {"enabled": True, "quantize_change_ratio": 0.2}},
        "different_groups": {"w": {"params": {"start_bits": 6, "target_bits": 3, "quantization_period": 1}}}},
    "row_pruning": {"shared_parameters": {"enabled": True, "method": "topk", "schedule_offset": 1},
                    "different_groups": {"r": {"params": {"dense_ratio": 0.5}, "modules": ["^0$"],
                                               "related_modules": [["^2$"]]}}},
    "activation_quantization": {"shared_parameters": {"enabled": True, "schedule_offset": 2},
                                "different_groups": {"a": {"params": {"bits": 8}, "modules": ["^2$"]}}}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def run(stage: int, compression: dict[str, Any], steps: int = 4) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm
    from zerospeed.compression import init_compression

    world, rank = comm.get_world_size(), comm.get_rank()
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4 // world, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage},
              "compression_training": compression}
    model = init_compression(_model(), config)
    engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
        part = slice(rank * (4 // world), (rank + 1) * (4 // world))
        loss = nn.functional.mse_loss(engine(x[part]), y[part])
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().reshape(1))
    mean = torch.cat(losses)
    comm.all_reduce(mean, op=comm.ReduceOp.SUM) if world > 1 else None
    moq = engine.compression.moq
    bits = None if moq is None else [wq.bits for _, wq in moq.layers]
    return {"losses": (mean / world).tolist(), "steps": engine.compression.scheduler.training_steps, "bits": bits}


def test_compression_training_zero2_zero3_world2_equal_one_process() -> None:
    one = run_distributed(run, 1, 0, COMPRESSION, timeout=120)[0]
    assert one["steps"] == 4
    assert one["bits"] == [3, 3]  # quantize calls 1, 2, 4 (before step 1, after steps 1 and 3) drop a bit
    for stage in (2, 3):
        two = run_distributed(run, 2, stage, COMPRESSION, timeout=120)
        torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
        assert two[0]["losses"] == two[1]["losses"] and two[0]["bits"] == one["bits"] and two[0]["steps"] == 4


def test_initialize_refuses_plain_layers_and_quantizes_post_init() -> None:
    def at_load(_: int) -> tuple[str, str, bool]:
        import zerospeed
        from zerospeed.config import ConfigError

        config = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
                  "compression_training": COMPRESSION}
        try:
            zerospeed.initialize(model=_model(), config=config)
            refused = "no error"
        except ConfigError as exc:
            refused = str(exc)
        ptq = {"train_batch_size": 1, "weight_quantization": {"post_init_quant": {"2": {"num_bits": 4, "group_size": 16}}}}
        engine, _, _, _ = zerospeed.initialize(model=_model(), config=ptq)
        out = engine(torch.randn(1, 16))
        return refused, type(engine.module[2]).__name__, bool(torch.isfinite(out).all())

    refused, kind, finite = run_distributed(at_load, 1, 0, timeout=60)[0]
    assert "call zerospeed.compression.init_compression" in refused
    assert kind == "QuantizedLinear" and finite


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.blocks[1](torch.tanh(self.blocks[0](x)))).pow(2).mean()


def test_moq_eigenvalues_through_the_engine_set_per_block_periods() -> None:
    """quantize_training (legacy MoQ section) with its eigenvalue subsection: the engine differentiates the loss
    before the backward when a bit drop is due, and each block's next period is 4 x (1 + floor(4 e)). At world 2,
    each replica on its own micro-batch, the factors are averaged: both replicas set the same periods."""
    def train(_: int) -> tuple[list[int], list[int]]:
        import zerospeed
        from zerospeed import comm

        rank = comm.get_rank()
        config = {"train_batch_size": 2 * comm.get_world_size(), "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                  "quantize_training": {"enabled": True, "quantize_bits": {"start_bits": 8, "target_bits": 6},
                                        "quantize_schedule": {"quantize_period": 1, "schedule_offset": 0},
                                        "eigenvalue": {"enabled": True, "layer_name": "blocks", "layer_num": 2,
                                                       "tol": 1e-4}}}
        engine, _, _, _ = zerospeed.initialize(model=Blocks(), config=config)
        for step in range(2):
            loss = engine(torch.randn(2, 8, generator=torch.Generator().manual_seed(step + 100 * rank)))
            engine.backward(loss)
            engine.step()
        layers = engine.compression.moq.layers
        return [wq.bits for _, wq in layers], [wq.period for _, wq in layers]

    bits, periods = run_distributed(train, 1, 0, timeout=60)[0]
    assert bits == [6, 6]  # 8 -> 7 before the first forward, 7 -> 6 after step 1 (eigenvalues known then)
    assert 20 in periods and all(p in (4, 8, 12, 16, 20) for p in periods) and periods != [4, 4], periods
    first, second = run_distributed(train, 2, 0, timeout=60)
    assert first == second and first[0] == [6, 6], (first, second)


RESUME = {  # MoQ with a falling mixing ratio, learned rows from step 1, static ranges from 2, l1 sparsity from 5
    **COMPRESSION,
    "activation_quantization": {"shared_parameters": {"enabled": True, "schedule_offset": 2,
                                                      "range_calibration": "static"},
                                "different_groups": {"a": {"params": {"bits": 8}, "modules": ["^2$"]}}},
    "sparse_pruning": {"shared_parameters": {"enabled": True, "method": "l1", "schedule_offset": 5},
                       "different_groups": {"s": {"params": {"dense_ratio": 0.5}, "modules": ["^0$"]}}}}


def resume(ckpt: str) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm
    from zerospeed.compression import init_compression

    world, rank = comm.get_world_size(), comm.get_rank()
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 2},
              "compression_training": RESUME}

    def engine_() -> Any:
        return zerospeed.initialize(model=init_compression(_model(), config), config=config)[0]

    def train(engine: Any, steps: range) -> list[float]:
        losses = []
        for step in steps:
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
            loss = nn.functional.mse_loss(engine(x[rank * 2:rank * 2 + 2]), y[rank * 2:rank * 2 + 2])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        return losses

    def state(engine: Any) -> Any:
        rt = engine.compression
        return (rt.scheduler.training_steps, sorted(rt.scheduler.switched_on), rt.moq.state_dict())

    first = engine_()
    train(first, range(3))
    first.save_checkpoint(ckpt, tag="k3")
    saved = state(first)
    straight = train(first, range(3, 6))
    fresh = engine_()
    fresh.load_checkpoint(ckpt, tag="k3")
    loaded = state(fresh)
    resumed = train(fresh, range(3, 6))
    first.load_checkpoint(ckpt, tag="k3")  # a rollback: what was switched on after step 3 goes off again
    rolled = (state(first), train(first, range(3, 6)))
    assert world == 2
    return {"saved": saved, "loaded": loaded, "straight": straight, "resumed": resumed, "rolled": rolled,
            "end": state(first), "ranges": first.module[2].activation_quantizer.x_min_max.tolist()}


def test_compression_state_checkpoint_resume_and_rollback_equal_the_uninterrupted_run(tmp_path: Any) -> None:
    """ZeRO-2, world 2: save at step 3, then (a) a fresh engine loads and trains 3 steps, (b) the saving engine,
    3 steps further, rolls back and trains them again: both equal the uninterrupted steps 4-6 exactly. The
    replicas keep one static activation range (taken over both micro-batches)."""
    out, other = run_distributed(resume, 2, str(tmp_path), timeout=120)
    assert out["ranges"] == other["ranges"] and out["ranges"][0] < out["ranges"][1]
    assert out["saved"] == out["loaded"] == out["rolled"][0]
    assert out["saved"][:2] == (3, ["activation_quantization", "row_pruning", "weight_quantization"])
    assert out["end"][1][-1] == "weight_quantization" and "sparse_pruning" in out["end"][1]
    torch.testing.assert_close(torch.tensor(out["resumed"]), torch.tensor(out["straight"]), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(out["rolled"][1]), torch.tensor(out["straight"]), rtol=1e-6, atol=0)
