"""PipelineEngine contract: DeepSpeed's errors and accessors, eval_batch, data slicing, tuple/mask/int
activations, dynamic shapes, activation checkpointing, bf16, ZeRO-2 refusal, and a dead stage reported."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.config import ConfigError
from zerospeed.pipe import LayerSpec, PipelineModule
from zerospeed.testing import DistributedTestError, run_distributed

from .pipe_fixtures import batches, gpt_pipe, rank_iter, reference_losses

MICRO = 2


def _cfg(gas: int, **extra: Any) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "gradient_clipping": 0.0, **extra}


def _api() -> dict:
    from zerospeed.parallel.pipeline.module import PipelineError

    engine, *_ = zerospeed.initialize(model=gpt_pipe(2), config=_cfg(2))
    errors = []
    for call in (lambda: engine(torch.zeros(1)), lambda: engine.backward(torch.zeros(())), engine.step):
        try:
            call()
        except PipelineError as exc:
            errors.append(str(exc))
    data = batches(1, MICRO, 2)
    loss, logits = engine.eval_batch(rank_iter(data, 0, 2), return_logits=True)
    g = engine.grid
    return {"errors": errors, "first": engine.is_first_stage(), "last": engine.is_last_stage(),
            "eval": float(loss), "logits": None if logits is None else tuple(logits.shape),
            "mpu": (g.get_pipe_parallel_rank(), g.get_pipe_parallel_world_size(), g.get_data_parallel_rank(),
                    g.get_data_parallel_world_size(), g.get_model_parallel_world_size(),
                    g.get_tensor_model_parallel_world_size(), g.get_pipeline_model_parallel_rank()),
            "params": sorted({n.split(".")[0] for n, _ in engine.module.named_parameters()}),
            "parts": engine.module.partitions(), "owner": [engine.module.stage_owner(i) for i in range(6)]}


def test_engine_contract_and_eval_batch() -> None:
    r0, r1 = run_distributed(_api, 2)
    assert r0["errors"] == ["Only train_batch() is accessible in pipeline mode."] * 3
    assert (r0["first"], r0["last"], r1["first"], r1["last"]) == (True, False, False, True)
    expected = reference_losses(batches(1, MICRO, 2), 1e-2, 0.0)[0]  # loss before any update
    assert r0["eval"] == pytest.approx(expected, rel=1e-6) and r1["eval"] == pytest.approx(expected, rel=1e-6)
    assert r1["logits"] == (MICRO, 8, 32) and r0["logits"] is None
    assert r0["mpu"] == (0, 2, 0, 1, 2, 1, 0) and r1["mpu"][0] == 1
    # each stage built only its own layers (uniform: [0, 3, 6]); the tied embedding lives on both ends
    assert r0["parts"] == [0, 3, 6] and r0["owner"] == [0, 0, 0, 1, 1, 1]
    assert r0["params"] == ["1", "2", "tied_modules"] and r1["params"] == ["3", "4", "tied_modules"]


def _zero2() -> str:
    try:
        zerospeed.initialize(model=gpt_pipe(2), config=_cfg(2, zero_optimization={"stage": 2}))
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def test_zero_stage_2_is_refused() -> None:
    msgs = run_distributed(_zero2, 2)
    assert all("ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" in m for m in msgs)


def _bad_stages() -> str:
    try:
        gpt_pipe(3)
    except RuntimeError as exc:
        return str(exc)
    return "accepted"


def test_stage_count_must_divide_world() -> None:
    assert run_distributed(_bad_stages, 2) == ["num_stages (3) must divide distributed world size (2)"] * 2


def _io() -> list[int]:
    from torch.utils.data import TensorDataset

    engine, *_ = zerospeed.initialize(model=gpt_pipe(2), config=_cfg(1))
    ds = TensorDataset(torch.arange(8))
    loader = engine.deepspeed_io(ds)
    return [int(v) for (x,) in loader for v in x]


def test_deepspeed_io_slices_per_data_parallel_replica() -> None:
    seen = run_distributed(_io, 4)  # pp=2 x dp=2: ranks 0,2 are replica 0; ranks 1,3 replica 1
    assert seen[0] == seen[2] and seen[1] == seen[3]
    assert sorted(seen[0] + seen[1]) == list(range(8)) and not set(seen[0]) & set(seen[1])


# --- tuple activations: a float tensor, a boolean mask and integer ids cross the stage boundary ---------
class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, h > 0, torch.arange(x.shape[-1]).expand(x.shape[0], -1).contiguous()


class Second(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, inputs: tuple) -> torch.Tensor:
        h, mask, ids = inputs
        return self.lin(h * mask + ids.double().float() * 0.01)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _tuple_data(steps: int, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(MICRO, 4, generator=g), torch.randn(MICRO, 3, generator=g)) for _ in range(steps * 2)]


def _tuple_train(pp: int) -> list[float]:
    layers = [LayerSpec(First), LayerSpec(Second)]
    model = PipelineModule(layers, num_stages=pp, loss_fn=_mse, seed_layers=True, partition_method="uniform")
    engine, *_ = zerospeed.initialize(model=model, config=_cfg(2))
    it = iter(_tuple_data(3, []))
    return [float(engine.train_batch(it)) for _ in range(3)]


def test_tuple_mask_and_integer_activations_match_one_stage() -> None:
    two = run_distributed(_tuple_train, 2, 2)
    one = run_distributed(_tuple_train, 1, 1)[0]
    assert two[0] == two[1] == pytest.approx(one, rel=1e-6)
    assert one[0] != one[-1]


class Trim(nn.Module):
    """Stage-0 layer whose output length depends on the data (shapes change between micro-batches)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = int(x[0, 0].abs().item() * 3) % 3 + 1
        return self.lin(x)[:, :keep]


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h.sum(dim=1, keepdim=True))


def _dynamic(dynamic: bool) -> Any:
    model = PipelineModule([LayerSpec(Trim), LayerSpec(Pool)], num_stages=2, loss_fn=_mse, seed_layers=True,
                           partition_method="uniform", dynamic_shape=dynamic)
    engine, *_ = zerospeed.initialize(model=model, config=_cfg(4))
    it = iter(_tuple_data(2, []) * 2)
    return [float(engine.train_batch(it)) for _ in range(2)]


def _reset_between_batches() -> list[float]:
    model = PipelineModule([LayerSpec(Trim), LayerSpec(Pool)], num_stages=2, loss_fn=_mse, seed_layers=True,
                           partition_method="uniform")
    engine, *_ = zerospeed.initialize(model=model, config=_cfg(1))
    data = _tuple_data(2, [])
    data = sorted(data, key=lambda b: int(b[0][0, 0].abs().item() * 3) % 3)  # shapes change only twice
    out = []
    for batch in data:
        engine.reset_activation_shape()
        out.append(float(engine.train_batch(iter([batch]))))
    return out


def test_reset_activation_shape_allows_a_new_shape_per_batch() -> None:
    a, b = run_distributed(_reset_between_batches, 2)
    assert a == b and len(a) == 4


def test_changing_shapes_need_dynamic_shape() -> None:
    with pytest.raises(DistributedTestError, match="dynamic_shape=True"):
        run_distributed(_dynamic, 2, False, timeout=30)
    out = run_distributed(_dynamic, 2, True)
    assert out[0] == out[1]


def _checkpointed(interval: int, from_config: bool = False) -> tuple:
    model = gpt_pipe(2, activation_checkpoint_interval=0 if from_config else interval)
    extra = {"pipeline": {"activation_checkpoint_interval": interval}} if from_config else {}
    engine, *_ = zerospeed.initialize(model=model, config=_cfg(2, **extra))
    it = rank_iter(batches(3, MICRO, 2), 0, 2)
    losses = []
    for _ in range(3):
        losses.append(float(engine.train_batch(it)))
    return losses, engine.module.activation_checkpoint_interval


def test_activation_checkpointing_every_layer_keeps_losses() -> None:
    plain, _ = run_distributed(_checkpointed, 2, 0)[0]
    ckpt, _ = run_distributed(_checkpointed, 2, 1)[0]
    via_config, interval = run_distributed(_checkpointed, 2, 1, True)[0]
    assert interval == 1
    assert ckpt == pytest.approx(plain, rel=1e-6) and via_config == ckpt
    assert plain == pytest.approx(reference_losses(batches(3, MICRO, 2), 1e-2, 0.0), rel=1e-5)


def _bf16() -> list[float]:
    engine, *_ = zerospeed.initialize(model=gpt_pipe(2), config=_cfg(2, bf16={"enabled": True}))
    it = rank_iter(batches(4, MICRO, 2), 0, 2)
    return [float(engine.train_batch(it)) for _ in range(4)]


def test_bf16_pipeline_tracks_fp32_reference() -> None:
    r0, r1 = run_distributed(_bf16, 2, timeout=120)
    expected = reference_losses(batches(4, MICRO, 2), 1e-2, 0.0)
    assert r0 == r1
    assert r0 == pytest.approx(expected, rel=2e-2)  # bf16 activations/weights, fp32 master and grad accumulation


def _dies(victim: int, pp: int) -> Any:
    from zerospeed import comm

    engine, *_ = zerospeed.initialize(model=gpt_pipe(pp), config=_cfg(2, comms_timeout_s=10))
    dp = engine.grid.get_data_parallel_world_size()
    it = rank_iter(batches(3, MICRO, 2 * dp), engine.grid.get_data_parallel_rank(), 2)
    engine.train_batch(it)
    if comm.get_rank() == victim:
        os._exit(3)
    t0 = time.monotonic()
    try:
        engine.train_batch(it)
    except comm.CollectiveError as exc:
        raise RuntimeError(f"after {time.monotonic() - t0:.2f}s: {exc}") from None
    return "no error"


def test_dead_stage_is_named_by_its_neighbour() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_dies, 2, 1, 2, timeout=60)
    text = str(info.value)
    assert "rank 1: process exited" in text
    assert "rank 0: p2p" in text and "(peer rank 1)" in text and "the peer process exited" in text


def test_dead_stage_is_named_by_every_stage() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_dies, 4, 1, 4, timeout=60)  # pp=4: rank 1 dies; rank 3 only sees rank 2 exit
    text = str(info.value)
    assert "rank 1: process exited" in text
    for r in (0, 2, 3):
        assert f"rank {r}: p2p" in text, text
    assert text.count("rank 1 is the first dead rank") == 3


def _accounting() -> dict:
    engine, *_ = zerospeed.initialize(model=gpt_pipe(2), config=_cfg(3))
    it = rank_iter(batches(2, MICRO, 3), 0, 3)
    engine.train_batch(it)
    first = engine.last_step_stats
    ahead = engine.channels.received_ahead
    engine.train_batch(it)
    st = engine.last_step_stats
    return {"ahead": (ahead, engine.channels.received_ahead, len(engine.channels.prefetched)),
            "first_sent": first.p2p_bytes_sent, "sent": st.p2p_bytes_sent, "received": st.p2p_bytes_received,
            "compute": st.compute_seconds, "total": st.total_seconds, "bubble": st.bubble_fraction,
            "reduce": st.reduce_step_seconds, "split": st.forward_seconds + st.backward_seconds,
            "piped": st.pipeline_seconds}


def test_per_step_accounting_counts_p2p_bytes_exactly() -> None:
    r0, r1 = run_distributed(_accounting, 2)
    act = MICRO * 8 * 16 * 4  # one micro-batch's activation (batch x seq x n_embd fp32) == its gradient
    assert r0["sent"] == r0["received"] == r1["sent"] == r1["received"] == 3 * act
    assert r0["first_sent"] > 3 * act  # the first batch also carried the shape handshake
    # of each batch's 3 receives per stage, the last 2 were posted ahead; none is left over after a batch
    assert r0["ahead"] == r1["ahead"] == (2, 4, 0)
    for r in (r0, r1):
        assert 0 < r["compute"] < r["total"] and 0 <= r["bubble"] < 1 and r["reduce"] > 0
        assert r["split"] == pytest.approx(r["compute"])
        assert r["compute"] < r["piped"] <= r["total"]  # span to the rank's last forward/backward


def _mpu() -> dict:
    from zerospeed import comm
    from zerospeed.config import NotSupportedYetError
    from zerospeed.runtime.pipe.topology import (PipeDataParallelTopology, PipelineParallelGrid,
                                                 PipeModelDataParallelTopology)

    grid = PipelineParallelGrid(PipeDataParallelTopology(num_pp=1, num_dp=4))
    engine, *_ = zerospeed.initialize(model=nn.Linear(2, 1), mpu=grid, config={
        "train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    three_d = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1))
    try:
        zerospeed.initialize(model=nn.Linear(2, 1), mpu=three_d, config={"train_batch_size": 8})
        refused = ""
    except NotSupportedYetError as exc:
        refused = str(exc)
    return {"dp": engine.dp_world_size, "refused": refused,
            "3d": (three_d.get_slice_parallel_rank(), three_d.get_slice_parallel_world_size(),
                   three_d.get_pipe_parallel_rank(), three_d.get_model_parallel_world_size(),
                   three_d.get_data_parallel_group_ranks(), comm.get_world_size(three_d.get_slice_parallel_group()))}


def test_initialize_accepts_a_grid_as_mpu() -> None:
    out = run_distributed(_mpu, 4)
    assert all(r["dp"] == 4 for r in out)
    assert all("model parallelism through mpu" in r["refused"] for r in out)
    # rank r of pipe x data x model (2, 1, 2): model rank r % 2, stage r // 2
    assert [r["3d"][:4] for r in out] == [(0, 2, 0, 4), (1, 2, 0, 4), (0, 2, 1, 4), (1, 2, 1, 4)]
    assert out[3]["3d"][4] == [3] and out[0]["3d"][5] == 2


def _fp16() -> tuple:
    cfg = _cfg(2, fp16={"enabled": True, "initial_scale_power": 8}, gradient_clipping=1.0)
    engine, *_ = zerospeed.initialize(model=gpt_pipe(2), config=cfg)
    it = rank_iter(batches(4, MICRO, 2), 0, 2)
    return [float(engine.train_batch(it)) for _ in range(4)], engine.loss_scale, engine.skipped_steps


def test_fp16_pipeline_tracks_fp32_reference() -> None:
    (r0, scale0, skipped0), (r1, scale1, _) = run_distributed(_fp16, 2, timeout=120)
    expected = reference_losses(batches(4, MICRO, 2), 1e-2, 1.0)
    assert r0 == r1 and scale0 == scale1 and skipped0 == 0
    assert r0 == pytest.approx(expected, rel=1e-2)  # fp16 weights/activations, fp32 master, loss scale 2**8


def _mesh() -> tuple:
    from zerospeed import comm
    from zerospeed.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid

    grid = PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=2))
    mesh = grid.device_mesh("cpu")
    return mesh.mesh.tolist(), mesh.mesh_dim_names, comm.get_world_size(mesh.get_group("data")), grid.dp_group


def test_grid_maps_onto_a_device_mesh() -> None:
    out = run_distributed(_mesh, 4)
    assert all(o[0] == [[0, 1], [2, 3]] and o[1] == ("pipe", "data") and o[2] == 2 for o in out)
    assert [o[3] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
