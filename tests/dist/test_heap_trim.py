"""A host engine gives glibc's freed heap back when backward starts (``accelerator/host_malloc.HeapTrimmer``):
memory the forward freed on the heap is no longer under backward's peak RSS; ``ZEROSPEED_TRIM_HEAP=0`` turns
it off. The math is untouched (same losses)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import zerospeed
from zerospeed.profiling.memory import _reset_hwm, peak_rss_bytes
from zerospeed.testing import run_distributed

MB = 1 << 20


class HeapHeavy(nn.Module):
    """Its forward leaves ~100 MiB of freed 64 KiB heap chunks between live ones (holes too small for any
    later large tensor: glibc keeps them resident); its backward then makes fresh 48 MiB gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(256, 256)
        self.held: list[torch.Tensor] = []  # stands for activations still alive in backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            parts = [torch.full((16_384,), float(i)) for i in range(3200)]  # 64 KiB each: on the heap
            self.held = parts[1::2]
            bias = sum(float(p[0]) for p in parts[:3])
        del parts  # every other chunk freed: 100 MiB of holes
        return (self.lin(x) + bias).pow(2).mean()


def _run(trim: str) -> dict[str, Any]:
    os.environ["ZEROSPEED_TRIM_HEAP"] = trim
    torch.manual_seed(0)
    model = HeapHeavy()
    config = {"train_micro_batch_size_per_gpu": 49_152, "steps_per_print": 10**9,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(49_152, 256, generator=torch.Generator().manual_seed(engine.global_rank))  # 48 MiB
    losses, peaks = [], []
    for _ in range(2):
        loss = engine(x)
        _reset_hwm()
        base = peak_rss_bytes()
        engine.backward(loss)
        peaks.append(peak_rss_bytes() - base)
        engine.step()
        losses.append(float(loss))
    trimmer = engine.heap_trimmer
    return {"peak": peaks[-1], "peaks": peaks, "losses": losses, "trims": None if trimmer is None else trimmer.trims}


def test_backward_peak_leaves_out_the_forwards_freed_heap() -> None:
    off = run_distributed(_run, 2, "0", timeout=120)
    for mode in ("1", "start"):  # the full trim, and the stage 2-3 default (only when backward starts)
        on = run_distributed(_run, 2, mode, timeout=120)
        for a, b in zip(on, off):
            assert a["trims"] and a["trims"] >= 2 and b["trims"] is None, (mode, a, b)
            assert a["losses"] == b["losses"]
            # the ~100 MiB of holes stay resident under backward's fresh gradients without the trim. The off-run
            # counts its larger step (both read ~192 MiB on a quiet machine): once, in CI, one rank's last step
            # read 48 MiB, as if 144 MiB had left the RSS between the high-water reset and backward's peak, which
            # hides that much growth under the old mark (cause not found); either step shows the retention.
            off_peak = max(b["peaks"])
            assert off_peak - a["peak"] >= 60 * MB, (mode, a["peak"] / MB, [p / MB for p in b["peaks"]])
