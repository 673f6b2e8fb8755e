"""The precision variants of issue 32: each trains, matches one process at world 2, and (where DeepSpeed runs
it on CPU) DeepSpeed 0.19.8's own losses on the parity fixture.

DeepSpeed's losses are pinned from ``benchmarks/ds_precision_losses.py`` (one process, CPU, Gloo; the command is
in its docstring): the same TinyNet, parameter groups, batches (global batch 4: micro-batch 2 x 2 accumulation
steps), AdamW lr 1e-2, clipping 0.5.
"""

from __future__ import annotations

from typing import Any

import torch

import zerospeed
from zerospeed import comm
from zerospeed.testing import run_distributed

from .parity import engine_losses, make_model, micro_batch, reference_losses

STEPS, MB, CLIP, LR = 6, 2, 0.5, 1e-2
# DeepSpeed 0.19.8, torch_autocast bf16: ZeRO stage 2 on one process, and stage 0 on one process or two (the same
# numbers: nothing is reduced in bf16)
DS_AUTOCAST_BF16 = [1.6147246211767197, 0.5622312426567078, 1.4381201267242432, 0.6487534493207932,
                    0.6124220192432404, 0.8355250954627991]
# ... ZeRO stages 1 and 2 on two ranks (``ds_precision_losses.py --world 2``): the Linear layers' gradients are
# reduced in bf16 (lower_precision_safe_modules), the rest in fp32; final norms of two parameters
DS_AUTOCAST_BF16_ZERO_W2 = [1.6147246211767197, 0.5622312426567078, 1.4381201267242432, 0.6492034941911697,
                            0.6120612025260925, 0.8349636495113373]
DS_AUTOCAST_BF16_ZERO_W2_NORMS = {"fc1.weight": 2.328442096710205, "head.bias": 0.3176775574684143}


def test_torch_autocast_bf16_at_world_2_matches_deepspeed() -> None:
    extra = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    for ranks in run_distributed(_each, 2, [(stage, extra) for stage in (0, 2, 3)], 1, timeout=120):
        (stage0, _, _), *zero = ranks  # (zerospeed on one process gives DS_AUTOCAST_BF16 at every stage)
        torch.testing.assert_close(torch.tensor(stage0), torch.tensor(DS_AUTOCAST_BF16), rtol=1e-5, atol=1e-6)
        for losses, state, _ in zero:  # stage 3: the same rule as DeepSpeed's stages 1-2
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(DS_AUTOCAST_BF16_ZERO_W2), rtol=1e-6,
                                       atol=1e-6)
            for k, v in DS_AUTOCAST_BF16_ZERO_W2_NORMS.items():
                assert abs(float(state[k].norm()) - v) <= 1e-6 * v, k
    fp32, _ = reference_losses(STEPS, MB, 2, 1, CLIP)
    assert max(abs(a - b) for a, b in zip(DS_AUTOCAST_BF16, fp32)) > 1e-4  # the bf16 matmuls did run
    assert abs(DS_AUTOCAST_BF16_ZERO_W2[-1] - DS_AUTOCAST_BF16[-1]) > 1e-4  # and the bf16 reductions


def _autocast_probes(cases: list[tuple[dict[str, Any] | None, bool]]) -> list[dict[str, Any]]:
    return [_autocast_probe(section, outer) for section, outer in cases]


def _autocast_probe(section: dict[str, Any] | None, outer: bool) -> dict[str, Any]:
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
                              "zero_optimization": {"stage": 1}}
    if section is not None:
        config["torch_autocast"] = section
    model = make_model()
    seen: list[str] = []
    model.fc1.register_forward_hook(lambda m, a, out: seen.append(str(out.dtype)))
    engine, *_ = zerospeed.initialize(model=model, config=config)
    x, y = micro_batch(0, 0, comm.get_rank(), comm.get_world_size(), 2, 1)
    with torch.autocast("cpu", dtype=torch.float16, enabled=outer):
        loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    engine.destroy()
    return {"seen": seen, "param": str(model.fc1.weight.dtype), "scale": engine.loss_scale,
            "applied": engine.was_step_applied(), "dtype": str(engine.torch_autocast_dtype()),
            "safe": engine.torch_autocast_lower_precision_safe_modules()}


def test_torch_autocast_region_dtype_nesting_and_fp16_scaler() -> None:
    cases = [({"enabled": True}, False), ({"enabled": True, "dtype": "bf16"}, True), (None, True),
             ({"enabled": True, "dtype": "fp16"}, False)]
    (default, inner_wins, off, fp16), = run_distributed(_autocast_probes, 1, cases, timeout=60)
    assert default["seen"] == ["torch.bfloat16"] and default["param"] == "torch.float32"  # CPU's default: bf16
    assert default["safe"][0] == "torch.nn.modules.linear.Linear" and default["scale"] == 1.0
    assert inner_wins["seen"] == ["torch.bfloat16"]  # the engine's section replaces the caller's fp16 autocast
    assert off["seen"] == ["torch.float32"]  # torch_autocast off: the caller's autocast is switched off, as DeepSpeed
    assert fp16["seen"] == ["torch.float16"] and fp16["applied"] and fp16["scale"] == 2.0 ** 16  # GradScaler's start


# --- 16-bit master weights and gradients; bf16 optimizer states -------------------------------------------------
BF16_MASTER_STATES = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
# DeepSpeed 0.19.8, the same keys, ZeRO stage 2 (stage 1: the same losses): the final fp32 norm of each parameter
DS_BF16_MASTER_STATES = {
    "losses": [1.611328125, 0.5625, 1.4375, 0.650390625, 0.61328125, 0.8359375],
    "norms": {"unused": 0.5976987481117249, "fc1.weight": 2.342665672302246, "fc1.bias": 0.7578210830688477,
              "fc2.weight": 2.361464023590088, "fc2.bias": 0.6110250949859619, "head.weight": 1.2166777849197388,
              "head.bias": 0.31805816292762756}}
# DeepSpeed 0.19.8, bf16 at stage 1: its BF16_Optimizer (data_types.grad_accum_dtype fp32), immediate_grad_update
# true or false, and its ZeRO optimizer (grad_accum_dtype bf16, its default for a bf16 model) give these same numbers
# (it rounds the accumulated gradients to bf16 either way); stage 2 gives them too.
DS_BF16_STAGE1 = {
    "losses": [1.611328125, 0.5625, 1.4375, 0.650390625, 0.615234375, 0.837890625],
    "norms": {"unused": 0.5937625765800476, "fc1.weight": 2.329244375228882, "fc1.bias": 0.7597234845161438,
              "fc2.weight": 2.3487892150878906, "fc2.bias": 0.6102635860443115, "head.weight": 1.2098509073257446,
              "head.bias": 0.3185659945011139}}


OFFLOAD = {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 200, "allgather_bucket_size": 300}


def _dtypes(engine: Any) -> dict[str, Any]:
    opt = engine.optimizer
    states = {str(v.dtype) for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.numel() > 1}
    return {"master": str(opt.groups[0].master_params[0].dtype), "states": sorted(states), "breakdown": engine.memory_breakdown()}


def _norms(state: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float(v.norm()) for k, v in state.items() if k != "frozen"}


def test_bf16_master_weights_and_optimizer_states_match_deepspeed() -> None:
    """bf16 master, gradients and Adam state on the device: world 2 equals DeepSpeed's one process."""
    for losses, state, info in run_distributed(engine_losses, 2, 2, STEPS, MB, 1, CLIP, LR, BF16_MASTER_STATES,
                                               _dtypes, timeout=120):
        assert losses == DS_BF16_MASTER_STATES["losses"]
        for k, v in _norms(state).items():
            assert abs(v - DS_BF16_MASTER_STATES["norms"][k]) <= 1e-6 * v, k
        assert info["master"] == "torch.bfloat16" and info["states"] == ["torch.bfloat16"]


# DeepSpeed 0.19.8 with ZeRO-Offload (DeepSpeedCPUAdam, its kernel loaded from a prebuilt cpu_adam.so:
# DS_CPU_ADAM_SO in benchmarks/ds_precision_losses.py), stage 2: final parameter norms (the losses are DS_BF16_STAGE1's)
DS_OFFLOAD_NORMS = {
    "bf16_master": {"unused": 0.5976987481117249, "fc1.weight": 2.3327317237854004, "fc1.bias": 0.7578189373016357,
                    "fc2.weight": 2.3509089946746826, "fc2.bias": 0.6110250949859619,
                    "head.weight": 1.2105056047439575, "head.bias": 0.31805816292762756},
    "bf16_master_states": {"unused": 0.5976987481117249, "fc1.weight": 2.3324551582336426,
                           "fc1.bias": 0.7578189373016357, "fc2.weight": 2.350654363632202,
                           "fc2.bias": 0.6110250949859619, "head.weight": 1.2103816270828247,
                           "head.bias": 0.31805816292762756}}


def test_16bit_master_weights_under_cpu_offload_match_one_process() -> None:
    """bf16 and fp16 master weights and gradients with the optimizer on the host (fp32 Adam state there, as
    DeepSpeedCPUAdam's default), and bf16 state too: world 2 equals one process, and DeepSpeed's weights (bf16:
    exactly with fp32 state; within 2e-5 with bf16 state, whose moments DeepSpeedCPUAdam rounds its own way;
    DeepSpeed refuses fp16 on this CPU)."""
    cases = [({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "torch.float32", "bf16_master",
              1e-6),
             ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
              "torch.bfloat16", "bf16_master_states", 2e-5),
             ({"fp16": {"enabled": True, "initial_scale_power": 8, "fp16_master_weights_and_grads": True}},
              "torch.float32", "", 0.0)]
    runs = [(2, {**extra, "zero_optimization": OFFLOAD}) for extra, *_ in cases]
    (singles,) = run_distributed(_each, 1, runs, 2, timeout=120)
    for ranks in run_distributed(_each, 2, runs, 1, timeout=120):
        for (losses, state, info), (single, one, _), (_, state_dtype, ds, rtol) in zip(ranks, singles, cases):
            assert losses == single
            for k, v in state.items():
                torch.testing.assert_close(v, one[k], rtol=0, atol=0)
            assert info["master"] in ("torch.bfloat16", "torch.float16") and info["states"] == [state_dtype]
            if ds:
                assert losses == DS_BF16_STAGE1["losses"]
                for k, v in _norms(state).items():
                    assert abs(v - DS_OFFLOAD_NORMS[ds][k]) <= rtol * v, (ds, k)


def _each(runs: list[tuple[int, dict[str, Any]]], gas: int) -> list[Any]:
    """Several (stage, config) runs of the fixture in one process group (one fork for all of them)."""
    return [engine_losses(stage, STEPS, MB, gas, CLIP, LR, extra, _dtypes) for stage, extra in runs]


def test_bf16_immediate_grad_update_and_grad_accum_dtype() -> None:
    """immediate_grad_update (an accepted hint: zerospeed always moves each gradient into its buffer as it
    arrives) trains as without it, at world 2 as on one process. data_types.grad_accum_dtype bf16 accumulates
    in bf16 (half the gradient bytes) and equals DeepSpeed exactly; fp32 is zerospeed's default for bf16."""
    bf16 = {"enabled": True}
    extras = [{"bf16": {**bf16, "immediate_grad_update": True}}, {"bf16": {**bf16, "immediate_grad_update": False}},
              {"bf16": bf16, "data_types": {"grad_accum_dtype": "bf16"}},
              {"bf16": bf16, "data_types": {"grad_accum_dtype": "fp32"}}]
    (singles,) = run_distributed(_each, 1, [(1, extras[0])], 2, timeout=120)
    for on, off, acc16, acc32 in run_distributed(_each, 2, [(1, extra) for extra in extras], 1, timeout=120):
        assert on[0] == off[0] == acc32[0] == singles[0][0]
        for k, v in on[1].items():
            assert torch.equal(v, off[1][k]) and torch.equal(v, acc32[1][k]) and torch.equal(v, singles[0][1][k]), k
        assert acc16[0] == DS_BF16_STAGE1["losses"]
        for k, v in _norms(acc16[1]).items():
            assert abs(v - DS_BF16_STAGE1["norms"][k]) <= 1e-6 * v, k
        for k, v in _norms(on[1]).items():  # fp32 accumulation: within ~1.3e-4 of DeepSpeed's bf16-rounded sums
            assert abs(v - DS_BF16_STAGE1["norms"][k]) <= 3e-4 * v, k
        assert acc16[2]["breakdown"]["grads"] * 2 == acc32[2]["breakdown"]["grads"] > 0
