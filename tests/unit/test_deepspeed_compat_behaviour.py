"""DeepSpeed behaviours that its own unit tests rely on (issue 29): error classes, the monitor-config view,
the comms logger's profiling switch, ``trim_mean`` and the ZeRO-3 linear layer's name."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from zerospeed.config import ConfigError, load_config


def test_bad_gradient_allreduce_op_names_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"Invalid gradient_allreduce_op\. Supported operations: \['mean', 'sum'\]"):
        load_config({"train_batch_size": 4, "gradient_allreduce_op": "prod"})
    assert load_config({"train_batch_size": 4, "gradient_allreduce_op": "Sum"}).gradient_allreduce_op == "sum"


def test_initialize_without_a_model_is_a_value_and_an_assertion_error() -> None:
    for call in (lambda: zerospeed.initialize(model=None, config={"train_batch_size": 1}),
                 lambda: zerospeed.initialize(torch.nn.Linear(2, 2), config={"train_batch_size": 1})):  # args=model
        with pytest.raises(ValueError, match="needs model") as err:
            call()
        assert isinstance(err.value, AssertionError)


def test_tag_mismatch_under_fail_is_an_assertion_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from zerospeed.runtime.checkpoint import agree
    from zerospeed.runtime.checkpoint.errors import CheckpointError

    monkeypatch.setattr(agree.comm, "all_gather_object", lambda obj, group=None: [("a", "/x"), ("b", "/x")])
    with pytest.raises(CheckpointError, match="tag_validation is 'Fail'") as err:
        agree.agree_on_tag_and_dir("a", "/x", "FAIL", None)
    assert isinstance(err.value, AssertionError)
    with pytest.warns(UserWarning):
        assert agree.agree_on_tag_and_dir("a", "/x", "warn", None)[0] == "a"


def test_monitor_config_view_and_csv_monitor(tmp_path) -> None:
    from zerospeed.monitor.csv_monitor import csvMonitor
    from zerospeed.runtime.config import DeepSpeedConfig

    on = DeepSpeedConfig({"train_batch_size": 2, "csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                                                                 "job_name": "j"}}).monitor_config
    assert on.enabled and on.csv_monitor.job_name == "j" and not on.tensorboard.enabled
    mon = csvMonitor(on.csv_monitor)
    assert (mon.enabled, mon.output_path, mon.job_name) == (True, str(tmp_path), "j") and (tmp_path / "j").is_dir()
    off = DeepSpeedConfig({"train_batch_size": 2, "csv_monitor": {"output_path": str(tmp_path / "o")}}).monitor_config
    assert not off.enabled and not csvMonitor(off.csv_monitor).enabled and not (tmp_path / "o").exists()


def test_comms_logger_profiling_switch() -> None:
    from zerospeed.utils.comms_logging import CommsLogger

    log = CommsLogger()
    log.configure(enabled=True, prof_all=False, prof_ops=["broadcast"])
    log.start_profiling_comms()
    log.record("all_reduce", 8, 16)
    log.stop_profiling_comms()
    log.record("all_reduce", 4, 8)
    assert log.prof_all is False and log.stats["all_reduce"].sizes == {8: 1}  # the second is counted, not profiled


def test_trim_mean_leaves_its_argument_alone() -> None:
    from zerospeed.utils.timer import trim_mean

    data = [9.0, 1.0, 2.0, 3.0, 100.0]
    assert trim_mean(data, 0.2) == pytest.approx(14 / 3) and data == [9.0, 1.0, 2.0, 3.0, 100.0]
    assert trim_mean([], 0.1) == 0
    with pytest.raises(ValueError):
        trim_mean(data, 1.5)


def test_zero3_linear_is_a_linear_under_deepspeeds_name() -> None:
    from zerospeed.runtime.zero import linear

    torch.manual_seed(0)
    layer, x = linear.LinearModuleForZeroStage3(3, 2), torch.randn(4, 3)
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert torch.equal(layer(x), ref) and linear.zero3_linear_wrap(x, layer.weight).shape == (4, 2)
    with torch.amp.autocast(device_type="cpu"):
        assert layer(x).dtype == torch.bfloat16
    assert linear.autocast_custom_fwd.func is torch.amp.custom_fwd
    assert linear.autocast_custom_fwd.keywords == {"device_type": "cpu"}


def test_partitioned_shape_and_multiple_gather_handles() -> None:
    from zerospeed.runtime.zero import partition_parameters as pp
    from zerospeed.zero.stage3.param_store import partition

    p = torch.nn.Parameter(torch.ones(6))
    partition(p, None, persistent=False)  # one process: the whole value is this rank's shard
    assert list(p.shape) == pp.partitioned_param_data_shape and p.ds_status is pp.ZeroParamStatus.NOT_AVAILABLE

    class Handle:
        def __init__(self) -> None:
            self.got: dict | None = None

        def wait(self, **kwargs: object) -> None:
            self.got = kwargs

    handles = [Handle(), Handle()]
    pp.MultipleAllGatherHandles(handles).wait(handle_dependency=False)
    assert [h.got for h in handles] == [{"handle_dependency": False}] * 2


@pytest.mark.parametrize("extra, why", [
    ({"zero_optimization": {"stage": 3}}, "ZeRO stage 3"),
    ({"zero_optimization": {"stage": 2, "zenflow": {}}}, "ZenFlow"),  # before the zenflow section's own check
    ({"zero_optimization": {"stage": 1}, "compile": {"deepcompile": True}}, "DeepCompile"),
])
def test_sum_allreduce_refused_where_deepspeed_refuses_it(extra: dict, why: str) -> None:
    with pytest.raises(ConfigError, match=f"gradient_allreduce_op.*not supported with {why}"):
        load_config({"train_batch_size": 4, "gradient_allreduce_op": "Sum", **extra})
    assert load_config({"train_batch_size": 4, "gradient_allreduce_op": "sum",
                        "zero_optimization": {"stage": 2}}).gradient_allreduce_op == "sum"
