"""``initialize()`` + ``destroy()`` in a loop leaks no native threads and no address space (issue 31, item 12):
each engine's own process group (Gloo threads and buffers) is closed by ``destroy()``."""

from __future__ import annotations

import torch
from torch import nn

from zerospeed.testing import run_distributed


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1])


def _loop(stage: int, n: int) -> list[tuple[int, int]]:
    import zerospeed

    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, "steps_per_print": 10**9}
    out = []
    for _ in range(n):
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
        engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        loss = engine(torch.randn(1, 4)).sum()
        engine.backward(loss)
        engine.step()
        engine.destroy()
        del engine, model, loss
        out.append((_status("Threads:"), _status("VmSize:") // 1024))
    return out


def test_engines_built_in_a_loop_release_their_threads() -> None:
    for stage in (3,):  # the stage with the most parts (hooks, fetcher, param store)
        for rank, seen in enumerate(run_distributed(_loop, 2, stage, 4, timeout=90)):
            threads = [t for t, _ in seen]
            vm_mib = [v for _, v in seen]
            assert threads[-1] == threads[0], f"stage {stage} rank {rank}: native threads per loop {threads}"
            assert vm_mib[-1] - vm_mib[0] < 40, f"stage {stage} rank {rank}: address space (MiB) {vm_mib}"
