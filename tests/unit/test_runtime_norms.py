"""``deepspeed.runtime.utils``' gradient helpers in one process (no group): ``clip_grad_norm_`` is torch's clip
there, ``get_weight_norm`` marks a non-finite norm -1, ``CheckOverflow`` is this rank's verdict,
``count_used_parameters_in_backward`` counts what the running backward reaches. The multi-rank behaviour
(the expert group, the mean of the norms) is in tests/dist/test_runtime_norms.py."""

from __future__ import annotations

import math

import pytest
import torch

from zerospeed.runtime import utils as ds_utils


def _params(*grads: list[float]) -> list[torch.nn.Parameter]:
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(len(g)))
        p.grad = torch.tensor(g)
        out.append(p)
    return out


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_alone_is_torchs_clip(norm_type: float) -> None:
    expected, actual = _params([3.0, 4.0], [1.0]), _params([3.0, 4.0], [1.0])
    want = torch.nn.utils.clip_grad_norm_(expected, 0.5, norm_type=norm_type)
    got = ds_utils.clip_grad_norm_(actual, max_norm=0.5, norm_type=norm_type)
    assert torch.allclose(got.reshape(()), want, rtol=1e-6)
    for e, a in zip(expected, actual):
        assert torch.allclose(e.grad, a.grad, rtol=1e-6)


def test_clip_grad_norm_leaves_small_gradients_and_skips_missing_ones() -> None:
    params = _params([0.1, 0.0]) + [torch.nn.Parameter(torch.zeros(2))]  # the last has no grad
    norm = ds_utils.clip_grad_norm_(params, max_norm=10.0)
    assert torch.allclose(norm, torch.tensor([0.1])) and torch.equal(params[0].grad, torch.tensor([0.1, 0.0]))


def test_weight_norm_and_global_norm() -> None:
    assert ds_utils.get_weight_norm([torch.tensor([3.0]), torch.tensor([4.0])]) == pytest.approx(5.0)
    assert ds_utils.get_weight_norm([torch.tensor([1.0, -7.0])], norm_type=math.inf) == pytest.approx(7.0)
    assert ds_utils.get_weight_norm([torch.tensor([1.0, float("nan")])]) == -1
    tied = torch.tensor([100.0])
    tied.ds_pipe_replicated = True  # counted on another stage
    assert ds_utils.get_weight_norm([torch.tensor([3.0]), tied]) == pytest.approx(3.0)
    assert ds_utils.get_global_norm([3.0, 4.0]) == pytest.approx(5.0)


def test_check_overflow_alone() -> None:
    clean, bad = _params([1.0]), _params([1.0, float("inf")])
    assert not ds_utils.CheckOverflow([clean]).check()
    assert ds_utils.CheckOverflow([clean]).check([bad])
    assert ds_utils.CheckOverflow().check_using_norm([-1], reduce_overflow=False)
    assert not ds_utils.CheckOverflow().check_using_norm([2.5], reduce_overflow=False)
    split = torch.nn.Parameter(torch.zeros(1))
    split.model_parallel = True
    assert ds_utils.is_model_parallel_parameter(split) and not ds_utils.is_model_parallel_parameter(clean[0])


def test_count_used_parameters_in_backward() -> None:
    used, unused, frozen = (torch.nn.Parameter(torch.ones(1)) for _ in range(3))
    frozen.requires_grad_(False)
    seen: dict[str, int] = {}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen["count"] = ds_utils.count_used_parameters_in_backward([used, unused, frozen, used])
        return grad

    used.register_hook(hook)
    (used * 2.0 + frozen).sum().backward()
    assert seen["count"] == 1  # ``unused`` is not in this graph, ``frozen`` needs no gradient, ``used`` once
    with pytest.raises(RuntimeError, match="during backward"):
        ds_utils.count_used_parameters_in_backward([used])
