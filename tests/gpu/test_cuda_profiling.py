"""Profiling on CUDA (skipped without a device): measured memory is the allocator peak; flops equal DeepSpeed's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MB = 1024 * 1024


def test_measure_memory_uses_the_allocator_peak() -> None:
    from zerospeed.profiling.memory import measure_memory

    torch.cuda.init()
    with measure_memory("cuda") as m:
        t = torch.ones(256 * MB // 4, device="cuda")
        del t
    assert m.source.startswith("cuda allocator")
    assert m.growth_bytes >= 256 * MB, m


def test_gpt_flops_on_cuda_equal_deepspeeds() -> None:
    from tests.unit.flops_models import build
    from zerospeed.profiling.flops_profiler import FlopsProfiler

    fixture = json.loads((Path(__file__).parents[1] / "unit" / "fixtures" / "deepspeed_flops.json").read_text())
    model, (ids,) = build("zerospeed_gpt")
    model, ids = model.cuda(), ids.cuda()
    prof = FlopsProfiler(model)
    prof.start_profile()
    with torch.no_grad():
        model(ids)
    assert [prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()] == \
        fixture["cases"]["zerospeed_gpt"]["<root>"]
    prof.end_profile()
