"""compile.symmetric_memory on CUDA: the symmetric-memory all-gather (comm/symmetric.py) equals the plain one, and
DeepCompile ZeRO-3 trains with it to the losses it has without it (needs 2 GPUs; on one GPU, two ranks share the
device for the gather check)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _gather_check() -> dict[str, Any]:
    from zerospeed import comm
    from zerospeed.comm.symmetric import SymmetricGather

    rank, world = comm.get_rank(), comm.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    sym = SymmetricGather(None, dev, nbytes=64)
    same = {}
    for n, dtype in ((5, torch.float32), (100, torch.bfloat16), (300_000, torch.float32)):  # the last one grows it
        def shard(r: int) -> torch.Tensor:
            return (torch.arange(n, device=dev, dtype=torch.float32) + 128 * r).to(dtype)

        got = torch.empty(n * world, dtype=dtype, device=dev)
        sym.all_gather(got, shard(rank))
        same[n] = bool(torch.equal(got, torch.cat([shard(r) for r in range(world)])))
    return {"same": same, "capacity": sym.capacity, "gathers": sym.gathers}


def test_symmetric_all_gather_gives_every_ranks_shard() -> None:
    if torch.cuda.device_count() >= 2:
        results = run_distributed(_gather_check, 2, backend="nccl", timeout=300)
    else:  # one device: two spawned ranks map each other's workspace on it (a Gloo group carries the rendezvous)
        results = run_distributed(_gather_check, 2, backend="gloo", fresh=True, timeout=300)
    for r in results:
        assert r["same"] == {5: True, 100: True, 300_000: True}
        assert r["gathers"] == 3 and r["capacity"] >= 300_000 * 4


def _train(symmetric: bool) -> dict[str, Any]:
    from zerospeed import comm
    import zerospeed

    from ..dist.test_deepcompile import GAS, STEPS, _batch, _config, _gpt

    world, rank = comm.get_world_size(), comm.get_rank()
    config = _config(3, True)
    config["compile"]["symmetric_memory"] = symmetric
    model = _gpt()
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    torch._dynamo.reset()
    engine.compile(backend="aot_eager")
    losses = []
    for step in range(STEPS):
        total = torch.zeros((), device=engine.device)
        for micro in range(GAS):
            idx = _batch(step, micro, rank, world).to(engine.device)
            _, loss = engine(idx, idx)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / GAS
        comm.all_reduce(total)
        losses.append(float(total) / world)
    gathers = sum(g.gathers for g in engine.deepcompiled.symmetric)
    if symmetric:
        from zerospeed.comm import symmetric as sym

        for s in engine.zero3.shards:
            sym.disable(s.group)  # the next engine in this process gathers through NCCL again
    return {"losses": losses, "symmetric_gathers": gathers}


def _both() -> tuple[dict[str, Any], dict[str, Any]]:
    return _train(False), _train(True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DeepCompile with symmetric memory needs 2 GPUs (NCCL "
                    "refuses two ranks on one device)")
def test_deepcompile_zero3_with_symmetric_memory_equals_without() -> None:
    for plain, sym in run_distributed(_both, 2, backend="nccl", timeout=600):
        assert plain["symmetric_gathers"] == 0 and sym["symmetric_gathers"] > 0
        torch.testing.assert_close(sym["losses"], plain["losses"], rtol=1e-6, atol=0)
