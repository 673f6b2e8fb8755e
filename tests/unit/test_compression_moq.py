"""MoQ (issue 35 item 5): DeepSpeed 0.19.6's bit schedule (``runtime/quantize.py``: periods doubling, fp16 mixing,
the eigenvalue factor), the legacy ``quantize_training`` section over every layer, and the power iteration on the
Hessian-vector product; tier 0."""

from __future__ import annotations

import math

import torch
from torch import nn

from zerospeed.compression import init_compression
from zerospeed.compression.eigenvalue import Eigenvalue
from zerospeed.compression.moq import MoQ
from zerospeed.compression.runtime import compression_runtime
from zerospeed.config import load_config


def _moq_model(start: int, target: int, period: int, mixed: bool) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 4))
    init_compression(model, {"compression_training": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "fp16_mixed_quantize": {"enabled": mixed, "quantize_change_ratio": 0.3}},
        "different_groups": {"g": {"params": {"start_bits": start, "target_bits": target,
                                              "quantization_period": period}}}}}})
    for m in model:
        m.weight_quantization_enabled = True
    return model


def test_moq_schedule_and_forward_follow_deepspeeds_quantizer() -> None:
    model = _moq_model(8, 5, 2, mixed=True)
    moq = MoQ([(m.weight, m.weight_quant) for m in model], mixed=True, change_ratio=0.3)
    # hand-written DeepSpeed loop: qsteps += 1; ratio -= 0.3 (0 once <= 0); per weight: drop when qsteps >= period
    bits, period, ratio, seen = [8, 8], [2, 2], 1.0, []
    for qsteps in range(1, 12):
        moq.quantize()
        ratio = ratio - 0.3 if ratio > 0 else 0.0
        used = []
        for i in range(2):
            if bits[i] != 5 and qsteps >= period[i]:
                ratio, period[i], bits[i] = 1.0, period[i] << 1, bits[i] - 1
            used.append(ratio)
        seen.append(([m.weight_quant.bits for m in model], [m.weight_quant.period for m in model],
                     [round(m.weight_quant.ratio, 6) for m in model]))
        assert seen[-1] == (bits, period, [round(r, 6) for r in used]), qsteps
    assert bits == [5, 5] and period == [16, 16]
    w, wq = model[0].weight.detach(), model[0].weight_quant
    g = w.reshape(1, -1)
    scale = 2 * g.abs().amax() / 2**wq.bits
    q = ((g / scale).round().clamp(-(2 ** (wq.bits - 1)), 2 ** (wq.bits - 1) - 1) * scale).reshape(w.shape)
    x = torch.randn(3, 8)
    torch.testing.assert_close(model[0](x), nn.functional.linear(x, wq.ratio * w + (1 - wq.ratio) * q, model[0].bias))


def test_eigenvalue_factor_lengthens_a_blocks_period_and_overflow_skips() -> None:
    model = _moq_model(6, 4, 1, mixed=False)
    moq = MoQ([(m.weight, m.weight_quant) for m in model])
    moq.quantize(overflow=True)  # an overflowed step counts nothing without eigenvalues
    assert moq.qsteps == 0 and not model[0].weight_quant.started
    moq.quantize(block_eigenvalue={id(model[0].weight): (0.5, 0), id(model[1].weight): (1.0, 1)})
    assert [m.weight_quant.period for m in model] == [2 * (1 + math.floor(4 * 0.5)), 2 * 5]
    assert [m.weight_quant.bits for m in model] == [5, 5] and moq.any_precision_switch() is False


def test_power_iteration_finds_each_blocks_top_hessian_eigenvalue() -> None:
    blocks = nn.ModuleList([nn.Linear(3, 1, bias=False), nn.Linear(3, 1, bias=False)])
    curv = [torch.tensor([4.0, 1.0, 0.5]), torch.tensor([2.0, 1.5, 0.1])]
    holder = nn.Module()
    holder.blocks = blocks
    loss = sum(0.5 * (c * b.weight.reshape(-1) ** 2).sum() + b.weight.sum() for b, c in zip(blocks, curv))
    ev = Eigenvalue(max_iter=200, tol=1e-6, layer_name="blocks", layer_num=2).from_loss(loss, holder)
    assert ev[id(blocks[0].weight)][1] == 0 and ev[id(blocks[1].weight)][1] == 1
    assert abs(ev[id(blocks[0].weight)][0] - 1.0) < 1e-6 and abs(ev[id(blocks[1].weight)][0] - 0.5) < 1e-3
    grads = torch.autograd.grad(loss, [b.weight for b in blocks], create_graph=True)
    for b, g in zip(blocks, grads):  # DeepSpeed's contract: p.grad from backward(create_graph=True)
        b.weight.grad = g
    assert Eigenvalue(max_iter=200, tol=1e-6, layer_name="blocks", layer_num=2).compute_eigenvalue(holder) == ev


def test_quantize_training_section_makes_every_layer_moq() -> None:
    cfg = load_config({"train_batch_size": 1, "quantize_training": {
        "enabled": True, "quantize_bits": {"start_bits": 12, "target_bits": 8},
        "quantize_schedule": {"quantize_period": 50, "schedule_offset": 7}, "quantize_groups": 2,
        "quantize-algo": {"q_type": "asymmetric"}, "fp16_mixed_quantize": {"enabled": True}}})
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Conv2d(1, 2, 1))
    runtime = compression_runtime(cfg, model)
    assert runtime is not None and runtime.moq is not None and len(runtime.moq.layers) == 3
    wq = model[1].weight_quant
    assert (wq.start_bits, wq.target_bits, wq.period, wq.groups, wq.symmetric, wq.mixed) == (12, 8, 50, 2, False, True)
    runtime.before_forward()
    assert runtime.moq.qsteps == 0  # schedule_offset 7: MoQ waits
    for _ in range(7):
        runtime.after_step(True)
    assert runtime.scheduler.weight_quantization_enabled and runtime.moq.qsteps == 0
    runtime.after_step(True)
    assert runtime.moq.qsteps == 1 and wq.started


def test_schedule_state_round_trips_through_json_and_refuses_another_layer_reduction() -> None:
    import json

    cfg = load_config({"train_batch_size": 1, "quantize_training": {
        "enabled": True, "quantize_bits": {"start_bits": 8, "target_bits": 4},
        "quantize_schedule": {"quantize_period": 1, "schedule_offset": 0}}})
    runtimes = []
    for _ in range(2):
        rt = compression_runtime(cfg, nn.Sequential(nn.Linear(4, 4)))
        assert rt is not None and rt.moq is not None
        runtimes.append(rt)
    first, second = runtimes
    first.before_forward()
    for _ in range(5):
        first.after_step(True)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    second.before_forward()  # a loaded state has had step 0's check: nothing more counts
    assert (second.scheduler.training_steps, second.moq.qsteps) == (5, 6)
    assert [(wq.bits, wq.period) for _, wq in second.moq.layers] == [(5, 8)]
    assert second.check_state(first.state_dict()) == ""
    other = {**first.state_dict(), "layer_reduction": {"teacher_layer": [0, 2]}}
    assert "layer_reduction" in second.check_state(other)
    assert "MoQ schedule has 0 weights" in second.check_state({**first.state_dict(), "moq": None})
