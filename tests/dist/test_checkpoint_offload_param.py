"""Stage-3 parameter offload and checkpoints: state saved with parameters on disk loads without offload
(and the other way round), and training continues exactly as if uninterrupted."""

import pytest
import torch

from zerospeed.testing import run_distributed

from .ckpt_common import build, train

OFFLOAD = {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}}


def _zero(extra_zero: dict, nvme: str) -> dict:
    zero = {"stage": 3, "reduce_bucket_size": 200, "allgather_bucket_size": 300,
            "stage3_param_persistence_threshold": 0}
    for key, section in extra_zero.items():
        zero[key] = {**section, "nvme_path": nvme}
    return {"zero_optimization": zero}


def _straight(nvme: str) -> list[float]:
    return train(build(3, _zero({}, nvme)), 6)


def _save(ckpt: str, nvme: str, offloaded: bool) -> list[float]:
    engine = build(3, _zero(OFFLOAD if offloaded else {}, nvme))
    losses = train(engine, 3)
    engine.save_checkpoint(ckpt, tag="t")
    if engine.zero3 is not None and getattr(engine.zero3, "param_home", None) is not None:
        engine.zero3.param_home.close()
    return losses


def _resume(ckpt: str, nvme: str, offloaded: bool) -> list[float]:
    engine = build(3, _zero(OFFLOAD if offloaded else {}, nvme))
    engine.load_checkpoint(ckpt, tag="t")
    losses = train(engine, 3)
    if engine.zero3 is not None and getattr(engine.zero3, "param_home", None) is not None:
        engine.zero3.param_home.close()
    return losses


@pytest.mark.parametrize(("save_offloaded", "load_offloaded"), [(True, False), (False, True)])
def test_offloaded_parameters_round_trip(tmp_path, save_offloaded: bool, load_offloaded: bool) -> None:
    nvme = str(tmp_path)
    straight = run_distributed(_straight, 2, nvme, timeout=120)[0]
    first = run_distributed(_save, 2, str(tmp_path / "ckpt"), nvme, save_offloaded, timeout=120)[0]
    second = run_distributed(_resume, 2, str(tmp_path / "ckpt"), nvme, load_offloaded, timeout=120)[0]
    assert first + second == straight
