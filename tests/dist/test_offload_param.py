"""ZeRO-Infinity parameter offload (stage 3): shards on the host (cpu) or in swap files (nvme), alone and with
the optimizer state on disk, reproduce the non-offloaded stage 3 and the single-process reference (fp32,
world 2, 10 steps, rtol 1e-5). A failed read names the file and leaves the weights as they were; a failed
write makes later reads of that shard refuse. Closing the home removes its swap files."""

from __future__ import annotations

import errno
import gc
import os
from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .zero3_fixtures import config, make_model, micro_batch
from .zero3_fixtures import reference as zero3_reference
from .zero3_fixtures import run_engine

STEPS, MB, GAS, CLIP = 10, 2, 2, 0.5


def _param(device: str, path: str) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device, "buffer_count": 2, "buffer_size": 64}
    if device == "nvme":
        section.update(nvme_path=path, max_in_cpu=0)
    return section


def _run(zero: dict[str, Any], build_in_init: bool) -> dict[str, Any]:
    """run_engine, plus what the parameter home read and wrote (homes are tracked while the run lasts)."""
    from zerospeed.offload import param_home

    homes: list[Any] = []
    original = param_home.ParamHome.__init__

    def tracked(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        homes.append(self)

    param_home.ParamHome.__init__ = tracked  # type: ignore[method-assign]
    try:
        out = run_engine(3, STEPS, MB, GAS, CLIP, None, {**zero, "sub_group_size": 64}, build_in_init=build_in_init)
    finally:
        param_home.ParamHome.__init__ = original  # type: ignore[method-assign]
    out["homes"] = len(homes)
    out["read"] = sum(h.swapper.bytes_read for h in homes if h.swapper is not None)
    out["disk"] = sum(h.disk_bytes() for h in homes)
    out["payload"] = sum(sum(h.swapper.sizes.values()) for h in homes if h.swapper is not None)
    for h in homes:
        h.close()  # removes the swap files (also done when the home is collected, and at exit)
    homes.clear()
    gc.collect()
    return out


_PLAIN: list[dict[str, Any]] = []


def _plain() -> dict[str, Any]:
    if not _PLAIN:
        _PLAIN.append(run_distributed(_run, 2, {}, False, timeout=120)[0])
    return _PLAIN[0]


@pytest.mark.parametrize("param,optimizer,build_in_init", [
    ("cpu", "none", False), ("nvme", "none", True), ("cpu", "nvme", False), ("nvme", "nvme", False)])
def test_offload_param_parity(param: str, optimizer: str, build_in_init: bool, tmp_path) -> None:
    ref_losses, ref_state, _ = zero3_reference(STEPS, MB, GAS, 2, CLIP)
    plain = _plain()
    zero: dict[str, Any] = {"offload_param": _param(param, str(tmp_path))}
    if param == "nvme":  # re-gather for backward too (no reuse), so that backward reads the disk as well
        zero["stage3_max_reuse_distance"] = 0
    if optimizer == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3}
    results = run_distributed(_run, 2, zero, build_in_init, timeout=120)
    for r in results:
        assert r["homes"] == 1
        for expected in (ref_losses, plain["losses"]):
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(expected), rtol=1e-5, atol=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["fp32"][k].float(), v.float(), rtol=1e-5, atol=1e-6, msg=f"fp32 {k}")
            torch.testing.assert_close(r["state"][k], plain["state"][k], rtol=1e-5, atol=1e-6, msg=f"model {k}")
        assert r["eval"] == pytest.approx(plain["eval"], rel=1e-5)
        if param == "nvme":  # every forward and backward read the shards back from disk
            assert r["disk"] > 0 and r["read"] >= 2 * STEPS * GAS * r["payload"]
    assert os.listdir(tmp_path) == []


# --- faults ----------------------------------------------------------------------------------------------
def _fault(path: str, kind: str) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm
    from zerospeed.offload import swapper
    from zerospeed.zero import full_state_dict

    world, rank = comm.get_world_size(), comm.get_rank()
    cfg = config(3, MB, GAS, CLIP, offload_param=_param("nvme", path))
    model = make_model()
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def train(step: int) -> None:
        for m in range(GAS):
            x, y = micro_batch(step, m, rank, world, MB, GAS)
            engine.backward(engine(x, y))
            engine.step()

    train(0)
    before = full_state_dict(model, rank0_only=False)
    name = "_pread" if kind == "read" else "_pwrite"
    original = getattr(swapper, name)

    def broken(*args: Any) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    setattr(swapper, name, broken)
    raised = ""
    try:
        train(1)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        raised = f"{type(exc).__name__}: {exc}"
    finally:
        setattr(swapper, name, original)
    out: dict[str, Any] = {"raised": raised}
    if kind == "read":
        after = full_state_dict(model, rank0_only=False)
        out["unchanged"] = all(torch.equal(v, after[k]) for k, v in before.items())
    else:
        try:
            train(2)
            out["again"] = ""
        except Exception as exc:  # noqa: BLE001
            out["again"] = f"{type(exc).__name__}: {exc}"
    engine.zero3.param_home.close()
    return out


@pytest.mark.parametrize("kind", ["read", "write"])
def test_offload_param_io_failure_names_the_file(kind: str, tmp_path) -> None:
    for r in run_distributed(_fault, 2, str(tmp_path), kind, timeout=120):
        assert r["raised"].startswith("OffloadIOError") and ".swp" in r["raised"] and str(tmp_path) in r["raised"], r
        assert kind in r["raised"]
        if kind == "read":
            assert r["unchanged"], "a failed read changed the weights"
        else:  # the shard whose write failed is never read back as if it were good: the engine refuses to
            # go on (the write failed inside the parameter update), naming the file
            assert "OffloadIOError" in r["again"] and str(tmp_path) in r["again"], r
            assert "not trustworthy" in r["again"] or "inconsistent" in r["again"], r
    assert os.listdir(tmp_path) == []
