"""The training plan (runtime/plan.py): one table of refused combinations, checked without processes."""

from __future__ import annotations

from typing import Any

import pytest

from zerospeed.config import ConfigError, load_config
from zerospeed.config.errors import NotSupportedYetError
from zerospeed.runtime.plan import RULES, ModelFacts, OptimizerFacts, TrainPlan, check_rules, decide, plan_training

ADAMW = {"type": "AdamW", "params": {"lr": 1e-3}}


def _cfg(stage: int = 0, **extra: Any) -> Any:
    return load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": ADAMW,
                        "zero_optimization": {"stage": stage, **extra.pop("zero", {})}, **extra})


def _refusal(cfg: Any, facts: ModelFacts | None = None) -> str:
    try:
        plan_training(cfg, facts or ModelFacts(optimizer=OptimizerFacts(client=False)))
    except ConfigError as e:  # NotSupportedYetError is one
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_plan_is_frozen_and_reads_the_config() -> None:
    plan = plan_training(_cfg(2, zero={"offload_optimizer": {"device": "cpu"}}),
                         ModelFacts(optimizer=OptimizerFacts(client=False)))
    assert isinstance(plan, TrainPlan)
    assert (plan.stage, plan.offload_optimizer, plan.pipelined, plan.moe, plan.has_optimizer) == (2, "cpu", False,
                                                                                                 False, True)
    with pytest.raises(AttributeError):
        plan.stage = 3  # type: ignore[misc]


def test_fp8_config_errors() -> None:  # was tests/dist/test_fp8_training.py (world size 1, refusals only)
    assert "needs ZeRO stage 3" in _refusal(_cfg(2, fp8={"allgather_fp8": True}))
    msg = _refusal(_cfg(3, fp8={"allgather_fp8": True}, zero={"zero_quantized_weights": True}))
    assert "keep one" in msg


def test_offload_param_below_stage_3_is_accepted(tmp_path: Any) -> None:  # DeepSpeed ignores it (issue 29)
    plan = plan_training(_cfg(2, zero={"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}), ModelFacts())
    assert not plan.offload_param  # nothing is offloaded below stage 3 (the log line: tests/dist/test_offload_param.py)


@pytest.mark.parametrize(("cfg", "facts", "key", "kind"), [
    (dict(stage=2), ModelFacts(pipelined=True), "zero_optimization.stage", ConfigError),
    (dict(stage=3), ModelFacts(tensor_parallel=True), "zero_optimization.stage", NotSupportedYetError),
    (dict(stage=1), ModelFacts(tensor_parallel=True, mpu=True), "tensor_parallel", NotSupportedYetError),
    (dict(stage=1, sequence_parallel_size=2), ModelFacts(tensor_parallel=True), "sequence_parallel_size",
     NotSupportedYetError),
    (dict(stage=1, sequence_parallel_size=2), ModelFacts(moe=True), "sequence_parallel_size", NotSupportedYetError),
    (dict(stage=1, sequence_parallel_size=2), ModelFacts(pipelined=True), "sequence_parallel_size",
     NotSupportedYetError),
    (dict(stage=1), ModelFacts(moe=True, tensor_parallel=True), "tensor_parallel", NotSupportedYetError),
    (dict(stage=1, use_data_before_expert_parallelism=True), ModelFacts(moe=True, tensor_parallel=True,
                                                                        autoep_only=True),
     "use_data_before_expert_parallelism", NotSupportedYetError),
    (dict(stage=2, zero={"offload_optimizer": {"device": "cpu"}}), ModelFacts(moe=True, tensor_parallel=True,
                                                                              autoep_only=True),
     "tensor_parallel", NotSupportedYetError),
    (dict(stage=1), ModelFacts(mpu=True, mpu_model_parallel=2), "mpu", NotSupportedYetError),
    (dict(stage=1, sequence_parallel_size=4), ModelFacts(mpu_sequence_parallel=2), "sequence_parallel_size",
     ConfigError),
    (dict(stage=0, zero={"offload_optimizer": {"device": "cpu"}}), ModelFacts(), "zero_optimization.offload_optimizer",
     ConfigError),
    (dict(stage=1), ModelFacts(optimizer=OptimizerFacts(client=False, compresses=True, deepspeed_name="1bit-Adam")),
     "zero_optimization.stage", ConfigError),
    (dict(stage=0), ModelFacts(moe=True, optimizer=OptimizerFacts(client=False, compresses=True)), "optimizer",
     NotSupportedYetError),
    (dict(stage=1), ModelFacts(slice_parallel=2, optimizer=OptimizerFacts(client=False, orthogonalizes=True)),
     "optimizer.type", NotSupportedYetError),
    (dict(stage=1, progressive_layer_drop={"enabled": True}), ModelFacts(pipelined=True), "curriculum_learning",
     NotSupportedYetError),
    (dict(stage=2, zero={"offload_optimizer": {"device": "cpu", "super_offload": True}}), ModelFacts(),
     "zero_optimization.offload_optimizer.super_offload", ConfigError),
    (dict(stage=1, torch_autocast={"enabled": True}), ModelFacts(pipelined=True), "torch_autocast",
     NotSupportedYetError),
    (dict(stage=1, gradient_compression={"type": "topk", "ratio": 0.1}, zero={"stage": 2}),
     ModelFacts(optimizer=OptimizerFacts(client=False)), "gradient_compression", ConfigError),
    (dict(stage=3, zero={"zero_quantized_gradients": True}), ModelFacts(moe=True),
     "zero_optimization.zero_quantized_gradients", NotSupportedYetError),
    (dict(stage=0, gradient_allreduce_op="sum"), ModelFacts(optimizer=OptimizerFacts(client=False, compresses=True)),
     "gradient_allreduce_op", NotSupportedYetError),
    (dict(stage=1, managed_gradient_accumulation=False), ModelFacts(pipelined=True), "managed_gradient_accumulation",
     ConfigError),
    (dict(stage=3, zero={"mics_shard_size": 2}), ModelFacts(optimizer=OptimizerFacts(client=False, class_name="Lamb")),
     "zero_optimization.mics_shard_size", NotSupportedYetError),
    (dict(stage=1, quantize_training={"enabled": True}), ModelFacts(pipelined=True), "compression_training",
     NotSupportedYetError),
    (dict(stage=3, quantize_training={"enabled": True, "eigenvalue": {"enabled": True, "layer_num": 2}}),
     ModelFacts(), "eigenvalue", NotSupportedYetError),
    (dict(stage=1, quantize_training={"enabled": True, "eigenvalue": {"enabled": True, "layer_num": 2}}),
     ModelFacts(tensor_parallel=True), "eigenvalue", NotSupportedYetError),
])
def test_each_combination_is_refused_with_its_key(cfg: dict[str, Any], facts: ModelFacts, key: str,
                                                  kind: type) -> None:
    config = _cfg(**cfg)
    with pytest.raises(kind) as info:
        plan_training(config, facts)
    assert info.value.key == key
    assert any(k == key for k, _ in check_rules(decide(config, facts), config, facts))


def test_client_optimizer_rules() -> None:
    client = ModelFacts(optimizer=OptimizerFacts(client=True, cpu_kernel=False, class_name="SGD"))
    plan_training(_cfg(0), client)  # a config 'optimizer' section too: the client wins (runtime/deepspeed_rules.py)
    no_section = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 1, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match=r"client optimizer \(SGD\) that has no fast CPU kernel"):
        plan_training(no_section, client)
    sched = load_config({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "WarmupLR", "params": {}}})
    with pytest.raises(ConfigError, match="a scheduler needs an optimizer"):
        plan_training(sched, ModelFacts())
    plan_training(sched, ModelFacts(client_scheduler=True, optimizer=OptimizerFacts(client=True)))  # client wins


def test_supported_combinations_pass() -> None:
    assert plan_training(_cfg(2), ModelFacts(moe=True, tensor_parallel=True, autoep_only=True)).folding
    for facts in (ModelFacts(pipelined=True), ModelFacts(tensor_parallel=True), ModelFacts(moe=True),
                  ModelFacts(mpu=True, mpu_model_parallel=2, expert_tp=True), ModelFacts(mpu_sequence_parallel=2)):
        plan_training(_cfg(1), facts)
    assert all(r.key for r in RULES)  # every refusal names the config key
