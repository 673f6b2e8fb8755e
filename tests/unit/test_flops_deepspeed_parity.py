"""The flops profiler counts as DeepSpeed's does: per module FLOPs, MACs and params equal DeepSpeed 0.19.8's.

``fixtures/deepspeed_flops.json`` was written by DeepSpeed's own profiler (``scripts/deepspeed_flops_reference.py``)
on the models of ``flops_models.py``; the hand-computed tests below re-derive the headline numbers from
DeepSpeed's formulas, so a fixture regenerated wrongly would not pass silently either.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

from tests.unit.flops_models import CASES, build
from zerospeed.profiling.flops_profiler import FlopsProfiler, get_model_profile
from zerospeed.profiling.flops_profiler.report import module_params

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "deepspeed_flops.json").read_text())


def profile(name: str) -> tuple[torch.nn.Module, FlopsProfiler]:
    model, args = build(name)
    prof = FlopsProfiler(model)
    prof.start_profile()
    with torch.no_grad():
        model(*args)
    prof.stop_profile()
    return model, prof


@pytest.mark.parametrize("name", list(CASES))
def test_every_module_equals_deepspeed(name: str) -> None:
    model, prof = profile(name)
    expected = FIXTURE["cases"][name]
    ours = {}
    for module_name, module in model.named_modules():
        st = prof.module_stats(module)
        ours[module_name or "<root>"] = [st.flops, st.macs, module_params(module)]
    assert ours == expected
    assert [prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()] == expected["<root>"]


def test_conv_net_by_hand() -> None:
    """Conv(3->8, 3x3, pad 1, bias) BN ReLU MaxPool(2) Conv(8->16, 3x3, stride 2) BN ReLU AdaptiveAvg Linear Softmax."""
    n = 2
    conv1_out = n * 8 * 16 * 16
    conv1_macs = 9 * 3 * 8 * (n * 16 * 16)
    conv2_macs = 9 * 8 * 16 * (n * 3 * 3)  # 8x8 input, stride 2, no pad: 3x3 output
    conv2_out = n * 16 * 3 * 3
    fc_macs = n * 16 * 10
    macs = conv1_macs + conv2_macs + fc_macs
    common = (2 * conv1_macs + conv1_out          # conv1 with its bias adds
              + conv1_out + conv1_out             # ReLU, max pool (input elements)
              + 2 * conv2_macs                    # conv2, no bias
              + conv2_out + conv2_out             # ReLU, adaptive average pool (input elements)
              + 2 * fc_macs                       # linear: its bias is not counted
              + n * 10)                           # softmax
    for name, bn_per_element in [("conv_net_eval", 2), ("conv_net_train", 5)]:
        _, prof = profile(name)
        assert prof.get_total_macs() == macs
        assert prof.get_total_flops() == common + bn_per_element * (conv1_out + conv2_out)
    params = (3 * 8 * 9 + 8) + 2 * 8 + 8 * 16 * 9 + 2 * 16 + 16 * 10 + 10
    assert prof.get_total_params() == params


def _gpt_counts(layers: int, tokens: int, width: int, vocab: int, seq: int, heads: int, batch: int,
                addmm_bias: bool, softmax: bool) -> tuple[int, int]:
    """DeepSpeed's FLOPs and MACs of a GPT-2-shaped decoder: linears, attention products, GELU, norms."""
    proj_macs = tokens * width * (3 * width + width + 4 * width + 4 * width)
    attn_macs = 2 * batch * heads * seq * seq * (width // heads)
    head_macs = tokens * width * vocab
    macs = layers * (proj_macs + attn_macs) + head_macs
    per_layer = 2 * (proj_macs + attn_macs) + 2 * 5 * tokens * width  # two affine layer norms
    if addmm_bias:  # HF Conv1D runs torch.addmm: DeepSpeed adds the bias *vector's* elements once
        per_layer += 3 * width + width + 4 * width + width
    per_layer += batch * heads * seq * seq if softmax else 0
    per_layer += 0 if addmm_bias else tokens * 4 * width  # F.gelu counted; HF's gelu_new (tanh formula) is not
    return layers * per_layer + 5 * tokens * width + 2 * head_macs, macs


def test_gpts_by_hand() -> None:
    shape = dict(layers=2, tokens=32, width=32, vocab=96, seq=16, heads=2, batch=2)
    _, prof = profile("zerospeed_gpt")
    assert (prof.get_total_flops(), prof.get_total_macs()) == _gpt_counts(**shape, addmm_bias=False, softmax=False)
    _, prof = profile("hf_gpt2_sdpa")
    assert (prof.get_total_flops(), prof.get_total_macs()) == _gpt_counts(**shape, addmm_bias=True, softmax=False)
    _, prof = profile("hf_gpt2_eager")  # eager attention: matmuls + F.softmax
    assert (prof.get_total_flops(), prof.get_total_macs()) == _gpt_counts(**shape, addmm_bias=True, softmax=True)


def test_operators_and_uncounted_functions() -> None:
    class Ops(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2 + x                       # operators: DeepSpeed never sees them
            y = torch.tanh(y).sigmoid()         # not in DeepSpeed's table
            y = y.softmax(-1)                   # Tensor.softmax: not counted (F.softmax is)
            return x.mul(y).add(torch.add(x, 1.0)) + torch.mul(x[0], y)  # 3 counted calls, broadcast

    x = torch.randn(4, 6)
    flops, macs, _ = get_model_profile(Ops(), args=[x], print_profile=False, as_string=False)
    assert (flops, macs) == (3 * 24 + 24, 0)


def test_signatures_are_deepspeeds() -> None:
    names = list(inspect.signature(FlopsProfiler).parameters)
    assert names[:3] == ["model", "ds_engine", "recompute_fwd_factor"]
    engine = object()
    prof = FlopsProfiler(torch.nn.Linear(2, 2), engine, 1.0)
    assert prof.ds_engine is engine and prof.recompute_fwd_factor == 1.0
    params = inspect.signature(get_model_profile).parameters
    assert list(params) == ["model", "input_shape", "args", "kwargs", "print_profile", "detailed", "module_depth",
                            "top_modules", "warm_up", "as_string", "output_file", "ignore_modules", "mode"]
    assert [params[n].default for n in ("print_profile", "detailed", "module_depth", "top_modules", "warm_up",
                                        "as_string", "mode")] == [True, True, -1, 1, 1, True, "forward"]


def test_ignored_modules_count_for_their_parent() -> None:
    """DeepSpeed's ignore_list drops a module's own row; the functions it calls still count for the parent."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[torch.nn.ReLU])
    model(torch.randn(2, 8))
    assert prof.module_stats(model[1]).flops == 0
    assert prof.get_total_flops() == 2 * (2 * 8 * 8 + 2 * 8 * 4) + 2 * 8
    prof.end_profile()
