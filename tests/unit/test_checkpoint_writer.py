"""``checkpoint.writer`` (DeepSpeed's fast / python writers) over zerospeed's safetensors files, tier 0:
the fast writer's file is the python writer's byte for byte (same sha256), a write error in its thread
reaches the caller, and the section is read (decoupled -> background writes, refusals named)."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from zerospeed.config import ConfigError, load_config
from zerospeed.runtime.checkpoint import writer as writer_mod
from zerospeed.runtime.checkpoint.tensor_file import TensorReader, write_tensors


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"master/a": torch.randn(3000, generator=g), "optim/exp_avg/a": torch.randn(7, 11, generator=g),
            "empty": torch.empty(0), "b16": torch.randn(513, generator=g).to(torch.bfloat16)}


def _writer(**kw: object) -> object:
    return load_config({"train_batch_size": 1, "checkpoint": {"writer": kw}}).checkpoint.writer


@pytest.mark.parametrize("double", [True, False])
def test_fast_writer_file_is_the_python_writers_byte_for_byte(tmp_path, double: bool) -> None:
    tensors = _tensors()
    plain = write_tensors(str(tmp_path / "p.safetensors"), tensors, {"format": "pt"})
    fast_cfg = _writer(type="fast", io_buffer_size=4096, io_buffer_double=double)
    fast = write_tensors(str(tmp_path / "f.safetensors"), tensors, {"format": "pt"}, fast_cfg)
    py = write_tensors(str(tmp_path / "y.safetensors"), tensors, {"format": "pt"}, _writer(type="python"))
    assert fast == plain == py
    data = (tmp_path / "f.safetensors").read_bytes()
    assert data == (tmp_path / "p.safetensors").read_bytes() and hashlib.sha256(data).hexdigest() == fast[1]
    with TensorReader(str(tmp_path / "f.safetensors")) as r:
        assert all(torch.equal(r.read(k), v) for k, v in tensors.items())


def test_a_write_error_in_the_writer_thread_reaches_the_caller(tmp_path) -> None:
    sink = writer_mod.BufferedSink(str(tmp_path / "x.safetensors"), 4096, True)
    os.close(sink._f.fileno())  # the disk goes away under the writer thread
    try:
        with pytest.raises(OSError, match="checkpoint write to .* failed"):
            for _ in range(8):
                sink.put(b"\0" * 8192)
            sink.close()
    finally:
        sink.abort()
    assert not sink._thread.is_alive()


def test_the_writer_section_is_read() -> None:
    cfg = load_config({"train_batch_size": 1, "checkpoint": {"writer": {"type": "FAST", "decoupled": True}}})
    assert cfg.checkpoint.writer.type == "fast" and cfg.checkpoint.background_writes
    assert not load_config({"train_batch_size": 1}).checkpoint.background_writes
    assert isinstance(writer_mod.open_sink(os.devnull, cfg.checkpoint.writer), writer_mod.BufferedSink)
    for bad, key in (({"type": "mock"}, "writer.type"), ({"data_parallel": "machine"}, "writer.data_parallel"),
                     ({"io_multiplier": 4}, "writer.io_multiplier"), ({"io_buffer_size": 10}, "io_buffer_size")):
        with pytest.raises(ConfigError, match=key):
            load_config({"train_batch_size": 1, "checkpoint": {"writer": bad}})


def test_checkpoint_serialization_false_writes_and_reads_torch_legacy_files(tmp_path) -> None:
    """Written: the torch files beside a checkpoint (the HF Trainer's scheduler.pt) take the legacy format;
    read: a DeepSpeed checkpoint saved with checkpoint_serialization false converts to the same tensors."""
    import shutil
    import zipfile
    from pathlib import Path

    from zerospeed.runtime.checkpoint import convert_deepspeed, layout
    from zerospeed.runtime.checkpoint.deepspeed_read import safe_load
    from zerospeed.runtime.checkpoint.torch_file import save_torch

    cfg = load_config({"train_batch_size": 1, "checkpoint": {"checkpoint_serialization": False}}).checkpoint
    assert cfg.checkpoint_serialization is False
    save_torch({"last_epoch": 3}, tmp_path / "legacy.pt", cfg.checkpoint_serialization)
    save_torch({"last_epoch": 3}, tmp_path / "zip.pt")
    assert not zipfile.is_zipfile(tmp_path / "legacy.pt") and zipfile.is_zipfile(tmp_path / "zip.pt")
    assert torch.load(tmp_path / "legacy.pt", weights_only=True) == {"last_epoch": 3}
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed" / "stage2" / "step3"
    outs = []
    for legacy in (False, True):
        ds = tmp_path / f"ds{legacy}"
        shutil.copytree(fixture, ds / "global_step3")
        (ds / "latest").write_text("global_step3")
        if legacy:  # the model states (the optimizer file holds DeepSpeed's classes, which only DeepSpeed pickles)
            pt = ds / "global_step3" / "mp_rank_00_model_states.pt"
            save_torch(safe_load(str(pt)), pt, False)
            assert not zipfile.is_zipfile(pt)
        convert_deepspeed(str(ds), str(tmp_path / f"out{legacy}"))
        manifest = layout.read_json(str(tmp_path / f"out{legacy}" / "global_step3" / layout.MANIFEST))
        outs.append({k: v["sha256"] for k, v in manifest["files"].items() if k.endswith(".safetensors")})
    assert outs[0] == outs[1] and outs[0]


def test_offload_core_shares_follow_deepspeeds_split() -> None:
    """Issue 32 item 5 (tier 0): cpuadam_cores_perc -> the host step's torch threads, restored after;
    pt_reserved_cores_perc -> ceil(perc * n) cores for training, the rest for ZenFlow's overlapped update."""
    from zerospeed.offload import cores

    cfg = load_config({"train_batch_size": 1, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 0.5},
        "zenflow": {"pt_reserved_cores_perc": 0.3, "overlap_step": True}}}).zero_optimization
    assert cfg.offload_optimizer.cpuadam_cores_perc == 0.5 and cfg.zenflow.pt_reserved_cores_perc == 0.3
    assert [cores.host_step_threads(0.5, n) for n in (1, 2, 8, 16)] == [1, 1, 4, 8]
    assert cores.split_cores(list(range(10)), 0.3) == ([0, 1, 2], [3, 4, 5, 6, 7, 8, 9])
    assert cores.split_cores([5], 0.5) == ([5], [5])  # one core: shared
    before = torch.get_num_threads()
    with cores.host_step(1e-9):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ConfigError, match="cpuadam_cores_perc"):
        load_config({"train_batch_size": 1, "zero_optimization": {"offload_optimizer": {"cpuadam_cores_perc": 0}}})
