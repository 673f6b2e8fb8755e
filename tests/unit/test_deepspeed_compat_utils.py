"""DeepSpeed names its unit tests reach (issue 29): ``utils`` (``groups``' stateless helpers, ``zero_to_fp32``,
``OnDevice``, ``comms_logging``, the grad setters), ``launcher.runner``, ``PartitionedTensor``, the ZeRO-3
``ds_*`` attributes. In this process: a test that builds an engine joins a one-rank group, and the
``alone`` fixture leaves the process as it found it (no group, the launcher variables unset)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.config import NotSupportedYetError


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch):
    """initialize() in this process: the group it joins and the variables it sets go away afterwards."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # recorded, so monkeypatch restores (or removes) it at the end
        monkeypatch.delenv(key)
    yield
    if zerospeed.comm.is_initialized():
        zerospeed.comm.destroy()


def test_expert_parallel_ranks_of_a_tensor_parallel_grid() -> None:
    from zerospeed.utils.groups import _get_expert_parallel_ranks

    ep, edp = _get_expert_parallel_ranks(world_size=8, tensor_parallel_size_=2, expert_parallel_size_=2)
    assert ep == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert edp == [[0, 4], [2, 6], [1, 5], [3, 7]]
    ep, _ = _get_expert_parallel_ranks(8, 1, 2, pipeline_parallel_size_=2)  # experts never span stages
    assert ep == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_groups_without_a_process_group() -> None:
    from zerospeed.utils import groups

    assert groups._get_data_parallel_world_size() == 1 and groups._get_data_parallel_rank() == 0
    with pytest.raises(RuntimeError, match="_create_expert_and_data_parallel needs an initialized"):
        groups._create_expert_and_data_parallel(2)
    with pytest.raises(NotSupportedYetError, match="_create_model_parallel"):
        groups._create_model_parallel(2)
    assert groups._get_max_expert_size() is None
    with pytest.raises(AssertionError, match="ep_size_2.*_create_expert_and_data_parallel"):
        groups._get_expert_parallel_group("ep_size_2")  # DeepSpeed asserts; zerospeed's is also a ValueError


def test_get_optim_files_natural_order(tmp_path) -> None:
    from zerospeed.utils.zero_to_fp32 import get_optim_files

    names = [f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt" for i in (10, 2, 1)]
    for n in names:
        (tmp_path / n).write_text("")
    assert [os.path.basename(f) for f in get_optim_files(str(tmp_path))] == [names[2], names[1], names[0]]
    with pytest.raises(FileNotFoundError):
        get_optim_files(str(tmp_path / "none"))


def test_fp32_state_dict_from_a_zero_checkpoint(tmp_path, alone) -> None:
    from zerospeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                              get_fp32_state_dict_from_zero_checkpoint,
                                              load_state_dict_from_zero_checkpoint)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    engine, *_ = zerospeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    engine.backward(engine(torch.randn(2, 4, dtype=torch.bfloat16)).float().square().mean())
    engine.step()
    engine.save_checkpoint(str(tmp_path), tag="t")
    master = {n: zerospeed.utils.safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))  # 'latest' -> t
    assert sorted(state) == sorted(master)
    for name, value in master.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value)
    convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path), str(tmp_path / "out"), tag="t")
    assert torch.equal(torch.load(tmp_path / "out" / "pytorch_model.bin")["1.weight"], master["1.weight"])
    fresh = load_state_dict_from_zero_checkpoint(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), str(tmp_path))
    assert torch.equal(fresh[0].bias.data, master["0.bias"])


def test_on_device_builds_in_the_dtype_and_device() -> None:
    from zerospeed import OnDevice
    from zerospeed.utils import OnDevice as same

    assert same is OnDevice
    before = torch.get_default_dtype()
    with OnDevice(dtype=torch.half, device="meta"):
        layer = nn.Linear(3, 4)
        index = torch.arange(3)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.half and index.dtype == torch.int64
    assert torch.get_default_dtype() == before and torch.empty(1).device.type == "cpu"
    with OnDevice(dtype=torch.half, enabled=False):
        assert nn.Linear(2, 2).weight.dtype == before


def test_comms_logging_path() -> None:
    from zerospeed.comm import CommsLogger
    from zerospeed.utils.comms_logging import CommsLogger as ds_name

    assert ds_name is CommsLogger


def test_partitioned_tensor_meta_round_trip_and_prefix_sums() -> None:
    from zerospeed.runtime.utils import PartitionedTensor, prefix_sum_inc

    assert prefix_sum_inc([1, 2, 3, 4]) == [1, 3, 6, 10]
    full = torch.arange(15.0).view(5, 3)
    part = PartitionedTensor(full, group=None)
    assert part.local_size() == torch.Size([15]) and torch.equal(part.full(), full)
    meta = part.to_meta()
    assert meta.tolist() == [2, 5, 3, 1, 0, 15]
    again = PartitionedTensor.from_meta(meta, part.data(), None)
    assert torch.equal(again.full(), full)
    with pytest.raises(ValueError, match="2 parts"):
        PartitionedTensor.from_meta(torch.tensor([1, 4, 2, 0, 2, 4]), torch.zeros(2), None)


def test_launcher_runner_names() -> None:
    from zerospeed.launcher import runner

    hosts = {"a": [0, 1, 2], "b": [0, 1]}
    assert runner.parse_resource_filter(hosts, exclude_str="a:1@b") == {"a": [0, 2]}
    assert runner.parse_inclusion_exclusion({"a": 3, "b": 2}, "b:1", "") == {"b": [1]}
    assert runner._parse_hostfile(["a slots=2", "# c", "b slots=1"]) == {"a": 2, "b": 1}
    with pytest.raises(ValueError):
        runner._parse_hostfile(["a slots=2", "a slots=1"])
    with pytest.raises(ValueError, match="--num_nodes"):
        runner.main(["--num_nodes", "1", "-i", "localhost", "train.py"])


@pytest.mark.parametrize("stage", [0, 2])
def test_safe_set_grad_is_what_the_step_uses(stage: int, alone) -> None:
    from zerospeed.utils import safe_get_full_grad, safe_get_local_grad, safe_set_full_grad, safe_set_local_grad

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    engine, *_ = zerospeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}}})
    before = (model.weight.detach().clone(), model.bias.detach().clone())
    engine.backward(engine(torch.randn(1, 3)).sum())
    safe_set_full_grad(model.weight, torch.full((2, 3), 0.5))
    safe_set_local_grad(model.bias, torch.tensor([1.0, -1.0]))
    assert torch.equal(safe_get_full_grad(model.weight), torch.full((2, 3), 0.5))
    assert torch.equal(safe_get_local_grad(model.bias).reshape(-1), torch.tensor([1.0, -1.0]))
    engine.step()
    assert torch.allclose(model.weight.detach(), before[0] - 0.5)
    assert torch.allclose(model.bias.detach(), before[1] - torch.tensor([1.0, -1.0]))


def test_deepspeed_optimizer_wrapper_names_answer_isinstance_truthfully(alone) -> None:
    from zerospeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from zerospeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3, estimate_zero3_model_states_mem_needs
    from zerospeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert callable(estimate_zero3_model_states_mem_needs)  # the module's own names stay
    engine, *_ = zerospeed.initialize(model=nn.Linear(2, 2), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    for name in (FP16_UnfusedOptimizer, DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        assert not isinstance(engine.optimizer, name)
    with pytest.raises(NotImplementedError, match="ZeroOptimizer"):
        DeepSpeedZeroOptimizer()


def test_reduce_scatter_coalesced_one_rank() -> None:
    from zerospeed.runtime.comm.coalesced_collectives import all_to_all_quant_reduce, reduce_scatter_coalesced

    a, b = torch.arange(6.0), torch.arange(3.0).view(3, 1)
    out_a, out_b = reduce_scatter_coalesced([a, b])
    assert torch.equal(out_a, a) and torch.equal(out_b, b.reshape(-1))
    with pytest.raises(NotImplementedError, match="zero_quantized_gradients"):
        all_to_all_quant_reduce([a], None)


def test_inference_all_reduce_one_rank() -> None:
    x = torch.arange(4.0)
    assert zerospeed.comm.inference_all_reduce(x) is None and torch.equal(x, torch.arange(4.0))


def test_ds_attributes_follow_the_stage3_state(alone) -> None:
    """What transformers, PEFT and TRL read, kept true by stage 3; parameters cut by offload (world 1)."""
    from zerospeed.runtime.zero.partition_parameters import ZeroParamStatus

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    full = model[0].weight.detach().clone()
    engine, *_ = zerospeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                              "stage3_param_persistence_threshold": 0}})
    w = model[0].weight
    assert isinstance(w, nn.Parameter) and hasattr(w, "ds_id") and w.shape == (0,)
    assert (w.ds_numel, w.ds_shape, w.ds_persist, w.partition_numel()) == (35, torch.Size([7, 5]), False, 35)
    assert w.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert torch.equal(w.ds_tensor, full.reshape(-1))
    assert len({p.ds_id for p in model.parameters()}) == 4
    with zerospeed.zero.GatheredParameters([w]):
        assert w.ds_status == ZeroParamStatus.AVAILABLE and w.shape == (7, 5)
    engine.backward(engine(torch.randn(2, 5)).square().sum())
    engine.step()
    assert w.ds_status == ZeroParamStatus.NOT_AVAILABLE and not torch.equal(w.ds_tensor, full.reshape(-1))
    assert not hasattr(nn.Linear(2, 2).weight, "ds_id")
    assert not hasattr(copy.deepcopy(w), "ds_numel")  # a copy is not in the stage-3 table


def _reuse_engine(stage: int) -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    engine, *_ = zerospeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"}, "stage3_max_reuse_distance": 10**6,
                              "stage3_param_persistence_threshold": 0}})
    return model, engine


def test_empty_partition_cache_releases_what_stage3_keeps_gathered(alone) -> None:
    """After a recorded step, stage 3 keeps parameters gathered from forward for backward (reuse distance);
    ``empty_partition_cache()`` releases them, the backward gathers again, and training is unchanged."""
    from zerospeed.zero.stage3.param_store import ShardState

    x = torch.randn(2, 5)
    finals = []
    for empty in (False, True):
        model, engine = _reuse_engine(3)
        for step in range(3):
            loss = engine(x).square().sum()
            if step == 2:
                assert engine.zero3.fetcher.kept and {s.state for s in engine.zero3.shards} == {ShardState.GATHERED}
            if empty:
                engine.empty_partition_cache()
                assert not engine.zero3.fetcher.kept
                assert {s.state for s in engine.zero3.shards} == {ShardState.SHARDED}
            engine.backward(loss)
            engine.step()
        finals.append([p.ds_tensor.clone() for p in model.parameters()])
        zerospeed.comm.destroy()
    assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))
    model, engine = _reuse_engine(1)  # below stage 3: nothing to release, and no error
    engine.empty_partition_cache()


def test_alone_left_no_group_and_no_launcher_variables() -> None:
    assert not zerospeed.comm.is_initialized() and "MASTER_PORT" not in os.environ


def test_unwrap_model_for_generation_gathers_once_drops_the_hooks_and_puts_them_back(alone) -> None:
    """Inside the block every ZeRO-3 parameter is whole and no module carries a stage-3 hook (plain forwards);
    after it the hooks are back and training goes on exactly as without the block."""
    from zerospeed.runtime.zero import unwrap_model_for_generation
    from zerospeed.zero.stage3.param_store import ShardState

    def hooked(model: nn.Module) -> int:
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    x = torch.randn(2, 5)
    finals = []
    for unwrap in (False, True):
        model, engine = _reuse_engine(3)
        for step in range(3):
            if unwrap and step == 1:
                n_hooks = hooked(model)
                with unwrap_model_for_generation(engine) as same:
                    assert same is engine and hooked(model) == 0
                    assert {s.state for s in engine.zero3.shards} == {ShardState.GATHERED}
                    assert model[0].weight.shape == (7, 5)
                    for _ in range(2):
                        with torch.no_grad():
                            engine(x)
                assert hooked(model) == n_hooks > 0
                assert {s.state for s in engine.zero3.shards} == {ShardState.SHARDED}
            engine.backward(engine(x).square().sum())
            engine.step()
        finals.append([p.ds_tensor.clone() for p in model.parameters()])
        zerospeed.comm.destroy()
    assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))
    plain = nn.Linear(2, 2)  # no stage 3 (a plain module, or an engine below stage 3): yielded as it is
    with unwrap_model_for_generation(plain) as same:
        assert same is plain
