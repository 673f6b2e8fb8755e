"""ZeRO++ qwZ (``zero_quantized_weights``): block-wise int8 weight all-gathers under stage 3.

The quantised all-gather hands every rank exactly what each rank's int8 blocks dequantise to; the engine's
forward/backward gathers then move a quarter of the fp32 bytes (plus per-block scales), and training stays
close to plain ZeRO-3."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.comm import dequantize_int8, quant_groups, quantize_int8
from zerospeed.testing import run_distributed


def test_group_rule_is_deepspeeds() -> None:
    # ceil(n / 8000), up until 8 * groups divides n, then doubled while blocks stay above 8000
    assert [quant_groups(n) for n in (8, 16, 8000, 8008, 16000, 64000, 4096, 1 << 20)] == [1, 1, 1, 7, 2, 8, 1, 256]
    with pytest.raises(ValueError):
        quant_groups(12)


def test_quantize_is_symmetric_int8_per_block() -> None:
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    x[:32] *= 100.0  # two blocks of very different range keep their own scale
    q, s = quantize_int8(x, 2)
    assert q.dtype == torch.int8 and s.shape == (2,)
    torch.testing.assert_close(s, torch.stack([x[:32].abs().max(), x[32:].abs().max()]) / 128)
    back = dequantize_int8(q, s, torch.float32)
    err = (back - x).abs().view(2, -1)
    assert (err <= s.view(2, 1) + 1e-6).all()  # +absmax clamps to 127: one step; the rest round: half a step
    assert (err.sort(dim=1).values[:, :-1] <= s.view(2, 1) / 2 + 1e-6).all()


def run_gather() -> dict[str, Any]:
    from zerospeed import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    send = torch.randn(21, generator=torch.Generator().manual_seed(rank)) * (rank + 1)  # 21: padded to 24
    out = torch.empty(21 * world)
    comm.COMMS_LOGGER.reset()
    handle = comm.quantized_all_gather(out, send, async_op=True)
    handle.wait()
    return {"out": out, "bytes": comm.COMMS_LOGGER.snapshot()["all_gather"].bytes}


@pytest.mark.parametrize("world", [2, 4])
def test_quantized_all_gather(world: int) -> None:
    results = run_distributed(run_gather, world, timeout=60)
    for r in range(world):
        send = torch.randn(21, generator=torch.Generator().manual_seed(r)) * (r + 1)
        q, s = quantize_int8(torch.cat([send, torch.zeros(3)]), 1)
        want = dequantize_int8(q, s, torch.float32)[:21]
        for res in results:
            assert torch.equal(res["out"][r * 21:(r + 1) * 21], want)
    assert results[0]["bytes"] == world * 24 + world * 4  # int8 values and one fp32 scale per rank


def run_stage3(quantized: bool, steps: int) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm
    from zerospeed.models import GPT, tiny

    rank = comm.get_rank()
    model = GPT(tiny(), seed=0)
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
              "optimizer": {"type": "Adam", "params": {"lr": 3e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "zero_quantized_weights": quantized}}
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    comm.COMMS_LOGGER.reset()
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(0, 256, (4, 32), generator=g)
        _, loss = engine(x, x.roll(-1, 1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    ag = comm.COMMS_LOGGER.snapshot()["all_gather"]
    return {"losses": losses, "bytes": ag.bytes, "count": ag.count}


def test_stage3_gathers_move_a_quarter_and_train_alike() -> None:
    plain = run_distributed(run_stage3, 2, False, 6, timeout=120)[0]
    quant = run_distributed(run_stage3, 2, True, 6, timeout=120)[0]
    assert quant["count"] == 2 * plain["count"]  # each gather: int8 blocks + their scales
    # a quarter of fp32, plus scales (4 bytes per block per rank) and padding to multiples of 8
    assert plain["bytes"] / 4 <= quant["bytes"] <= plain["bytes"] / 4 * 1.1, (quant["bytes"], plain["bytes"])
    assert quant["losses"] != plain["losses"]  # the weights really went through int8
    for a, b in zip(quant["losses"], plain["losses"]):
        assert abs(a - b) <= 0.02 * b
