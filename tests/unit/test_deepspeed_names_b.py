"""Names DeepSpeed's example scripts use (issue 29 part B): deepspeed.get_accelerator,
deepspeed.runtime.utils.set_random_seed, and init_inference joining the process group under a launcher."""

from __future__ import annotations

import random

import pytest
import torch


def test_top_level_get_accelerator() -> None:
    import zerospeed
    from zerospeed.accelerator import get_accelerator

    assert zerospeed.get_accelerator() is get_accelerator()


def test_set_random_seed_seeds_every_prng() -> None:
    import numpy

    from zerospeed.runtime.utils import partition_uniform, set_random_seed  # noqa: F401 - both names served

    set_random_seed(2**70 + 5)  # DeepSpeed's modulo: too-large seeds are accepted
    a = (random.random(), numpy.random.rand(), torch.rand(1).item())
    set_random_seed(2**70 + 5)
    assert (random.random(), numpy.random.rand(), torch.rand(1).item()) == a


def test_init_inference_with_tp_joins_the_process_group_under_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    from zerospeed import comm
    from zerospeed.inference import engine
    from zerospeed.inference.config import load_inference_config

    joined: list[bool] = []

    class Stop(Exception):
        pass

    def fake_join(*args: object, **kwargs: object) -> None:
        joined.append(True)
        raise Stop

    monkeypatch.setattr(comm, "is_initialized", lambda: False)
    monkeypatch.setattr(comm, "init_distributed", fake_join)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(Stop):
        engine._tp_group(load_inference_config({"tensor_parallel": {"tp_size": 2}}, {}))
    assert joined == [True]
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match="needs the process group first"):  # no launcher: the clear error stays
        engine._tp_group(load_inference_config({"tensor_parallel": {"tp_size": 2}}, {}))


def test_compression_helper_paths() -> None:
    from torch import nn

    from zerospeed.compression.helper import recursive_getattr, recursive_setattr

    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)))
    assert recursive_getattr(model, "0.0") is model[0][0]
    recursive_setattr(model, "0.0", nn.Identity())
    assert isinstance(model[0][0], nn.Identity)
