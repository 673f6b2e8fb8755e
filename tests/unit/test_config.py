"""Config: DeepSpeed keys and defaults; every mistake is a ConfigError naming the key."""

import json

import pytest

from zerospeed.config import ConfigError, NotSupportedYetError, load_config, resolve_batch


def test_defaults_match_deepspeed() -> None:
    cfg = load_config({"train_batch_size": 8}, 2)
    assert cfg.gradient_clipping == 1.0  # DeepSpeed 0.19.8 (0.0 before 0.19.3)
    assert cfg.fp16.enabled is False and cfg.fp16.initial_scale_power == 16
    assert cfg.fp16.loss_scale_window == 1000 and cfg.fp16.hysteresis == 2 and cfg.fp16.min_loss_scale == 1
    assert cfg.zero_optimization.stage == 0
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.steps_per_print is None
    assert cfg.zero_optimization.offload_optimizer.pin_memory and cfg.zero_optimization.offload_param.pin_memory
    assert cfg.bf16.check_grad_overflow is True


def test_json_path_and_bfloat16_alias(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "bfloat16": {"enabled": True}}))
    cfg = load_config(str(path), 4)
    assert cfg.bf16.enabled and cfg.batch(4).train_batch_size == 8


@pytest.mark.parametrize(
    ("tbs", "mb", "gas", "dp", "expected"),
    [
        (32, 4, None, 2, (32, 4, 4)),
        (32, None, 4, 2, (32, 4, 4)),
        (None, 4, 4, 2, (32, 4, 4)),
        (32, None, None, 4, (32, 8, 1)),
        (None, 3, None, 2, (6, 3, 1)),
        (32, 4, 4, 2, (32, 4, 4)),
    ],
)
def test_batch_rules(tbs, mb, gas, dp, expected) -> None:
    b = resolve_batch(tbs, mb, gas, dp)
    assert (b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps) == expected


def test_auto_batch_values_are_derived() -> None:
    cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                       "gradient_accumulation_steps": "auto"}, 2)
    assert cfg.batch(2).train_batch_size == 4


def test_inconsistent_triple_shows_arithmetic() -> None:
    with pytest.raises(ConfigError, match=r"train_batch_size.*10 != .*\(4\).*\(2\).*\(2\) = 16"):
        load_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2)


def test_impossible_batch_sizes() -> None:
    with pytest.raises(ConfigError, match="not divisible"):
        load_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 2)
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu.*positive"):
        load_config({"train_micro_batch_size_per_gpu": 0}, 2)
    with pytest.raises(ConfigError, match="at least one"):
        load_config({}, 2)


def test_misspelled_keys_get_did_you_mean() -> None:
    with pytest.raises(ConfigError, match=r"'gradient_acumulation_steps'.*Did you mean 'gradient_accumulation_steps'"):
        load_config({"train_batch_size": 8, "gradient_acumulation_steps": 2}, 2)
    with pytest.raises(ConfigError, match=r"'zero_optimization.reduce_bucket_sise'.*'reduce_bucket_size'"):
        load_config({"train_batch_size": 8, "zero_optimization": {"reduce_bucket_sise": 10}}, 2)
    with pytest.raises(ConfigError, match=r"'fp16.initial_scale_pow'.*'initial_scale_power'"):
        load_config({"train_batch_size": 8, "fp16": {"initial_scale_pow": 8}}, 2)


def test_wrong_types_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"'fp16.enabled'.*'maybe'"):
        load_config({"train_batch_size": 8, "fp16": {"enabled": "maybe"}}, 2)
    with pytest.raises(ConfigError, match=r"'gradient_clipping'"):
        load_config({"train_batch_size": 8, "gradient_clipping": -1}, 2)
    with pytest.raises(ConfigError, match=r"'zero_optimization.stage'"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 7}}, 2)
    with pytest.raises(ConfigError, match=r"'zero_optimization'.*valid dictionary"):
        load_config({"train_batch_size": 8, "zero_optimization": 2}, 2)


def test_unimplemented_deepspeed_keys_are_not_ignored() -> None:
    with pytest.raises(NotSupportedYetError, match=r"'amp'"):  # (pipeline_loading_checkpoint: implemented now)
        load_config({"train_batch_size": 8, "amp": {"enabled": True}}, 2)
    # switched off is honoured, not an error
    load_config({"train_batch_size": 8, "amp": {"enabled": False}, "elasticity": {"enabled": False}}, 2)


def test_fp16_and_bf16_together_is_an_error() -> None:
    with pytest.raises(ConfigError, match="fp16 and bf16"):
        load_config({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, 2)


def test_bad_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(str(bad))


# --- issue 10: every key honoured; real DeepSpeed configs get precise messages -----------------------------
def test_deepspeed_keys_we_lack_say_not_supported_yet_never_unknown() -> None:
    cases = [({"amp": {"enabled": True}}, "amp"),
             ({"hybrid_engine": {"enabled": True, "enable_cuda_graph": True}}, "hybrid_engine.enable_cuda_graph")]
    for extra, key in cases:
        with pytest.raises(NotSupportedYetError, match=rf"'{key}'.*not supported yet"):
            load_config({"train_batch_size": 8, **extra}, 2)


def test_deepspeed_off_values_are_accepted() -> None:
    cfg = load_config({"train_batch_size": 8, "sequence_parallel_size": 1, "torch_autocast": {"enabled": False},
                       "gradient_allreduce_op": "mean", "managed_gradient_accumulation": True,
                       "checkpoint": {"parallel_write": {"pipeline_stage": False}},
                       "bf16": {"enabled": False, "bf16_master_weights_and_grads": False},
                       "zero_optimization": {"stage": 1, "mics_shard_size": -1, "zero_hpz_partition_size": 1}}, 2)
    assert cfg.zero_stage == 1


def test_cpu_offload_is_deepspeeds_deprecated_alias(caplog) -> None:
    with caplog.at_level("WARNING", logger="zerospeed.config"):
        cfg = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": True}}, 2)
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert any("cpu_offload" in r.getMessage() and "deprecated" in r.getMessage() for r in caplog.records)
    off = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": False}}, 2)
    assert not off.zero_optimization.offload_optimizer.enabled
    par = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "cpu_offload_param": True}}, 2)
    assert par.zero_optimization.offload_param.device == "cpu"
    with pytest.raises(ConfigError, match="cpu_offload.*offload_optimizer.*together"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": True,
                                                                  "offload_optimizer": {"device": "nvme"}}}, 2)
    caplog.clear()
    with caplog.at_level("WARNING", logger="zerospeed.config"):
        load_config({"train_batch_size": 8, "zero_optimization": {"cpu_offload_use_pin_memory": True}}, 2)
    assert any("no effect" in r.getMessage() for r in caplog.records)


def test_unknown_keys_are_errors_unless_the_config_opts_in(caplog) -> None:
    raw = {"train_batch_size": 8, "cuda_visible_devices": "0,1", "zero_optimization": {"stage": 1, "bogus": 3}}
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(raw, 2)
    with pytest.raises(ConfigError, match="'cuda_visible_devices': unknown key"):
        load_config({"train_batch_size": 8, "cuda_visible_devices": "0"}, 2)
    with caplog.at_level("WARNING", logger="zerospeed.config"):
        cfg = load_config({**raw, "zerospeed": {"unknown_keys": "warn"}}, 2)
    assert cfg.zero_stage == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert any("'cuda_visible_devices'" in m for m in lines) and any("'zero_optimization.bogus'" in m for m in lines)
    assert raw["zero_optimization"] == {"stage": 1, "bogus": 3}  # the caller's dict is left alone
    with pytest.raises(ConfigError, match="zerospeed.unknown_keys"):
        load_config({**raw, "zerospeed": {"unknown_keys": "ignore"}}, 2)


def test_accepted_hints_are_logged_once_each(caplog) -> None:
    from zerospeed.config.hints import log_accepted_hints

    cfg = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "contiguous_gradients": False,
                                                                    "round_robin_gradients": True},
                       "optimizer": {"type": "Adam", "params": {"set_grad_none": True}}}, 2)
    with caplog.at_level("INFO", logger="zerospeed.config"):
        keys = log_accepted_hints(cfg)
    assert keys == ["zero_optimization.contiguous_gradients", "zero_optimization.round_robin_gradients",
                    "optimizer.params.set_grad_none"]
    assert len(caplog.records) == 3 and "contiguous bucket buffers" in caplog.records[0].getMessage()
    # changed from DeepSpeed's default (someone expected an effect): a warning; a restated default: info
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING", "INFO"]
    assert log_accepted_hints(load_config({"train_batch_size": 8}, 2)) == []


def test_args_deepspeed_config_and_config_together_is_an_error() -> None:
    from argparse import Namespace

    import zerospeed
    from torch import nn

    args = Namespace(deepspeed_config={"train_batch_size": 8}, local_rank=0)
    with pytest.raises(ConfigError, match="Not sure how to proceed"):
        zerospeed.initialize(args=args, model=nn.Linear(2, 2), config={"train_batch_size": 8})
    with pytest.raises(ConfigError, match="Not sure how to proceed"):
        zerospeed.initialize(args=Namespace(deepspeed_config="a.json", deepscale_config="b.json"), model=nn.Linear(2, 2))


def test_comms_logger_debug_names_the_caller(capsys) -> None:
    from zerospeed.comm.logger import CommsLogger

    log = CommsLogger()
    log.configure(True, verbose=True, debug=True)

    def issue_bucket_reduce() -> None:
        log.record("all_reduce", 64, 128)

    issue_bucket_reduce()
    assert "[Caller Func: issue_bucket_reduce]" in capsys.readouterr().out
    assert "[Caller Func: issue_bucket_reduce] 1 calls" in log.summary(2)
    log.configure(True, verbose=True, debug=False)
    issue_bucket_reduce()
    assert "Caller Func" not in capsys.readouterr().out


def test_number_checkpoints_bounds_contiguous_checkpoints() -> None:
    import torch

    from zerospeed import checkpointing

    layers = [torch.nn.Linear(4, 4) for _ in range(3)]

    def run(n: int) -> None:
        h = torch.randn(2, 4, requires_grad=True)
        for layer in layers[:n]:
            h = checkpointing.checkpoint(layer, h)
        h.sum().backward()

    try:
        checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
        run(2)
        run(2)  # regions are released by backward: the next step may hold as many again
        with pytest.raises(ConfigError, match="number_checkpoints"):
            run(3)
    finally:
        checkpointing.reset()
def test_pipeline_section_has_deepspeeds_keys() -> None:
    cfg = load_config({"train_batch_size": 8, "pipeline": {"stages": 2, "activation_checkpoint_interval": 1}}, 2)
    assert cfg.pipeline.activation_checkpoint_interval == 1 and cfg.pipeline.partition == "best"
    with pytest.raises(ConfigError, match=r"pipeline.*unknown key"):
        load_config({"train_batch_size": 8, "pipeline": {"stagez": 2}}, 2)
