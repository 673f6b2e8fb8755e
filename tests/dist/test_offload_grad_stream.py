"""ZeRO-Infinity without model-sized host tensors: under NVMe offload the fp32 master is written straight
into the swap files at ``initialize()`` (never resident), and at stages 2-3 each sub-group's reduced
gradients go to its swap file during backward (no fp32 gradient partition in memory). Training still
matches the non-offloaded run (``test_offload_parity.py`` covers stages 1-3 with accumulation and clipping);
here: what is (not) resident, gradients of unused sub-groups, overflow flags, and the norm."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .parity import make_model, micro_batch, param_groups
from .test_offload_parity import GAS, MB, SUB_GROUP


def _engine(stage: int, path: str, device: str = "nvme") -> tuple[Any, Any]:
    import zerospeed

    model = make_model()
    offload = {"device": device, "nvme_path": path, "buffer_count": 3} if device == "nvme" else {"device": device}
    config = {
        "train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "sub_group_size": SUB_GROUP,
                              "offload_optimizer": offload},
        "steps_per_print": 1000,
    }
    engine, opt, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine, opt


def _master_writes(stage: int, path: str) -> dict[str, Any]:
    from zerospeed.zero.sharded_group import ShardedGroup

    resident: list[bool] = []
    real = ShardedGroup.write_master_range

    def spy(self: ShardedGroup, lo: int, src: torch.Tensor) -> None:
        resident.append(self.master_home is None)
        real(self, lo, src)

    ShardedGroup.write_master_range = spy  # type: ignore[method-assign]
    try:
        engine, opt = _engine(stage, path)
    finally:
        ShardedGroup.write_master_range = real  # type: ignore[method-assign]
    ok = all(torch.equal(g.master_range(*g.slot_range(i)), _owned(g, i)) for g in opt.groups
             for i in range(len(g.params)))
    opt.stepper.close()
    return {"writes": len(resident), "resident": any(resident), "values_ok": ok}


def _owned(g: Any, i: int) -> torch.Tensor:
    """Parameter i's elements owned by this rank, zero-padded to its shard (what its master slot holds)."""
    slot = g.plan.slots[i]
    lo, hi = slot.owned_range(g.rank)
    out = torch.zeros(slot.shard)
    shard = getattr(g, "shards", None)
    if shard is not None and shard[i].local is not None:
        with shard[i].loaded() as local:
            return local.float().reshape(-1).clone()
    out[: hi - lo].copy_(g.params[i].detach().reshape(-1)[lo:hi])
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_initialize_writes_the_master_straight_to_the_swap_files(stage: int, tmp_path) -> None:
    for r in run_distributed(_master_writes, 2, stage, str(tmp_path), timeout=120):
        assert r["writes"] > 0 and not r["resident"], "the master was built in memory before it was swapped"
        assert r["values_ok"], "the swap files do not hold the model's values as the master"


def _resident_grads(stage: int, path: str) -> dict[str, Any]:
    from zerospeed import comm

    engine, opt = _engine(stage, path)
    reducer = opt.reducer
    world, rank = comm.get_world_size(), comm.get_rank()
    seen = []
    for m in range(GAS):
        x, y = micro_batch(0, m, rank, world, MB, GAS)
        engine.backward(engine(x, y))
        seen.append(reducer.grad_bytes())
        held = len(reducer.sink.held) if reducer.sink is not None else 0  # sub-groups written this step
        engine.step()
    partition = sum(g.plan.partition_numel for g in opt.groups) * 4
    norm = engine.get_global_grad_norm()
    opt.stepper.close()
    return {"grad_bytes": seen, "partition": partition, "held": held,
            "full": [f is None for f in reducer.store.full], "parts": [False for owner, _ in reducer.owned_tensors() if owner == "grad_partitions"], "norm": norm}


def _reference_norm(stage: int) -> float:
    from zerospeed import comm

    engine, _ = _engine(stage, "", device="cpu")
    world, rank = comm.get_world_size(), comm.get_rank()
    for m in range(GAS):
        x, y = micro_batch(0, m, rank, world, MB, GAS)
        engine.backward(engine(x, y))
        engine.step()
    return float(engine.get_global_grad_norm())


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_stream_to_the_swap_files(stage: int, tmp_path) -> None:
    results = run_distributed(_resident_grads, 2, stage, str(tmp_path), timeout=120)
    ref = run_distributed(_reference_norm, 2, stage, timeout=120)
    for r, norm in zip(results, ref):
        assert all(r["full"]) and all(r["parts"]), "a gradient buffer of the whole partition was allocated"
        assert max(r["grad_bytes"]) < r["partition"] / 2, r
        assert r["held"] > 2
        assert r["norm"] == pytest.approx(norm, rel=1e-5)  # from per-sub-group sums of squares



@pytest.mark.parametrize("copies", [False, True])
def test_sink_accumulates_flags_and_zeroes(copies: bool, tmp_path) -> None:
    """Unit test of ``SwappedGrads`` on hand-made sub-groups: accumulation across micro-steps (read back),
    the overflow flag, the sum of squares, and that ``zero()`` makes the next step start from zero. With
    ``copies`` the slices go through the accelerator's off-device copy queue (the CPU accelerator's here)."""
    from zerospeed.accelerator import CpuAccelerator
    from zerospeed.offload.grad_sink import GRAD, SwappedGrads
    from zerospeed.offload.state_store import state_layout
    from zerospeed.offload.subgroups import SubGroup
    from zerospeed.offload.swapper import AsyncSwapper

    sw = AsyncSwapper(str(tmp_path), block_size=4096)
    sgs = [SubGroup(0, 0, 0, 1000, [(0, 1000)]), SubGroup(0, 1, 1000, 1500, [(1000, 1500)])]
    keys = [("exp_avg", GRAD)]

    def ensure(sg: SubGroup) -> None:
        if sg.name not in sw.sizes:
            sw.allocate(sg.name, state_layout(sg, keys[0])[0])

    sink = SwappedGrads([sgs], keys, sw, ensure, CpuAccelerator() if copies else None)
    g1, g2 = torch.randn(1500), torch.randn(1500)
    for values in (g1, g2):  # two micro-steps, delivered in three uneven slices
        sink.add(0, 0, values[:700])
        sink.add(0, 700, values[700:1200])
        while sink.copies:
            sink._land()
        assert (0, 0) in sink.held and (0, 0) not in sink.open and (0, 1) in sink.open  # first one written, freed
        sink.add(0, 1200, values[1200:])
        sink.end_micro_step()
    back = torch.empty(1500)
    for sg in sgs:
        sw.read(sg.name, back[sg.lo:sg.hi], offset=sink.offset(sg)).wait()
    torch.testing.assert_close(back, g1 + g2, rtol=0, atol=0)
    assert sink.all_finite()
    torch.testing.assert_close(sink.sum_sq(), (g1 + g2).double().square().sum(), rtol=1e-12, atol=0)
    sink.zero()
    bad = torch.zeros(1500)
    bad[1300] = float("inf")
    sink.add(0, 0, bad)
    sink.end_micro_step()
    assert not sink.all_finite()
    sw.read("g0_s0", back[:1000], offset=sink.offset(sgs[0])).wait()
    assert back[:1000].abs().sum() == 0, "after zero() the next step must not accumulate onto the last one"
    sw.close()


def _host_sink(stage: int, force: bool) -> dict[str, Any]:
    from zerospeed.offload.grad_sink import HostGrads
    from zerospeed.runtime import build_optimizer as build

    real, add = build.gradients_off_device, HostGrads.add
    calls = [0]

    def counted(self: HostGrads, *args: Any) -> None:
        calls[0] += 1
        add(self, *args)

    HostGrads.add = counted  # type: ignore[method-assign]
    if force:  # what an accelerator gets under cpu offload, on this CPU-only machine
        build.gradients_off_device = lambda cfg, live: cfg.zero_optimization.offload_optimizer.device == "cpu"
    try:
        from .test_offload_parity import run

        out = run(stage, 4, {"device": "cpu"})
    finally:
        build.gradients_off_device, HostGrads.add = real, add  # type: ignore[method-assign]
    out["host_adds"] = calls[0]
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_host_gradient_partitions_match_the_device_ones(stage: int) -> None:
    """The ``HostGrads`` path (cpu offload on an accelerator: reduced buckets copied into host partitions)
    forced on this CPU: the same losses and weights, bit for bit, as the plain partitions."""
    plain = run_distributed(_host_sink, 2, stage, False, timeout=120)
    sunk = run_distributed(_host_sink, 2, stage, True, timeout=120)
    for a, b in zip(plain, sunk):
        assert a["host_adds"] == 0 and b["host_adds"] > 0
        assert a["losses"] == b["losses"]
        for k, v in a["state"].items():
            assert torch.equal(v, b["state"][k]), k


def _overflow(path: str) -> list[dict[str, Any]]:
    import zerospeed
    from zerospeed import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    model = make_model()
    config = {"train_micro_batch_size_per_gpu": 2,
              "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1, "loss_scale_window": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2, "sub_group_size": SUB_GROUP, "reduce_bucket_size": 200,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": path, "buffer_count": 3}}}
    engine, opt, _, _ = zerospeed.initialize(model=model, config=config)
    log = []
    for step in range(4):
        x, y = micro_batch(step, 0, rank, world, 2, 1)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        if step == 1 and rank == 1:
            handle = model.fc2.weight.register_hook(lambda g: g * float("inf"))
        engine.backward(engine(x.half(), y.half()))
        engine.step()
        if step == 1 and rank == 1:
            handle.remove()
        changed = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
        finite = all(torch.isfinite(v.float()).all() for v in model.state_dict().values())
        log.append({"scale": engine.loss_scale, "applied": engine.was_step_applied(), "changed": changed,
                    "finite": finite})
    opt.stepper.close()
    return log


def test_an_inf_gradient_in_the_swap_files_skips_the_step_everywhere(tmp_path) -> None:
    """fp16 under nvme offload (gradients streamed): the overflow flag comes from the sub-groups as they are
    written; the step is skipped on both ranks, and the next step does not see the inf gradient."""
    logs = run_distributed(_overflow, 2, str(tmp_path), timeout=120)
    assert logs[0] == logs[1]
    log = logs[0]
    assert log[0]["applied"] and log[0]["changed"]
    assert not log[1]["applied"] and not log[1]["changed"] and log[1]["scale"] == 512.0
    assert log[2]["applied"] and log[2]["changed"] and log[3]["applied"] and all(r["finite"] for r in log)


def test_separate_master_on_one_partition() -> None:
    """Offload with the model on an accelerator: even at one partition in fp32 the master is a copy of its own
    (it lives on the host), not the model; on the CPU without offload the model stays the master."""
    from torch import nn

    from zerospeed.zero.sharded_group import ShardedGroup

    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
    plain = ShardedGroup(params, {}, 1, 0, 100, torch.float32)
    separate = ShardedGroup(params, {}, 1, 0, 100, torch.float32, separate_master=True)
    assert plain.alias and plain.master is None
    assert not separate.alias and separate.master is not None
    assert separate.master_params[0].data_ptr() != params[0].data_ptr()
    torch.testing.assert_close(separate.master_params[0], params[0], rtol=0, atol=0)
