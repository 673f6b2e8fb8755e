"""The async swapper (round trips, O_DIRECT and buffered paths, length checks naming the file, cleanup),
the nvme_path preflight, the flat CPU kernels against torch.optim, and the offload config sections."""

from __future__ import annotations

import os

import pytest
import torch

from zerospeed.config import ConfigError, load_config
from zerospeed.offload import (AsyncSwapper, OffloadIOError, adam_step_flat, aligned_empty, check_nvme_path,
                               kernel_for)
from zerospeed.offload import preflight


@pytest.mark.parametrize("direct", [True, False])
def test_round_trip_aligned_and_unaligned(direct: bool, tmp_path) -> None:
    sw = AsyncSwapper(str(tmp_path), block_size=8192, threads=2, direct=direct)
    assert sw.direct == direct  # this disk (ext4) takes O_DIRECT; direct=False forces the page-cache path
    src = aligned_empty(40_000)[:40_000].view(torch.float32)  # a 4 KiB-aligned buffer: direct I/O
    src.copy_(torch.randn(10_000))
    odd = torch.randn(777)  # unaligned length and address: buffered I/O
    handles = [sw.write("a", src), sw.write("b", odd)]
    for h in handles:
        h.wait()
    back_a, back_b = aligned_empty(40_000)[:40_000].view(torch.float32), torch.empty(777)
    sw.read("a", back_a).wait()
    sw.read("b", back_b).wait()
    assert torch.equal(back_a, src) and torch.equal(back_b, odd)
    part = torch.empty(10)
    sw.read_range("a", 400, part)
    assert torch.equal(part, src[100:110])
    sw.write_range("a", 400, torch.zeros(10))
    sw.read("a", back_a).wait()
    assert back_a[100:110].abs().sum() == 0 and torch.equal(back_a[110:], src[110:])
    root_dir = sw.root
    sw.close()
    assert not os.path.exists(root_dir)


def test_short_or_missing_reads_raise_naming_the_file(tmp_path) -> None:
    sw = AsyncSwapper(str(tmp_path))
    t = torch.randn(5000)
    sw.write("x", t).wait()
    with pytest.raises(OffloadIOError, match=r"x\.swp.*never|nothing was written"):
        sw.read("never", torch.empty(3))
    with pytest.raises(OffloadIOError, match=r"x\.swp.*bytes asked"):
        sw.read("x", torch.empty(10))
    os.truncate(sw.path("x"), 64)
    with pytest.raises(OffloadIOError, match=r"x\.swp.*truncated"):
        sw.read("x", torch.empty(5000))
    sw.close()


def test_a_failing_transfer_raises_on_wait(tmp_path, monkeypatch) -> None:
    from zerospeed.offload import swapper

    sw = AsyncSwapper(str(tmp_path))
    sw.write("x", torch.randn(100)).wait()

    def eio(*args: object) -> int:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(swapper, "_pread", eio)
    handle = sw.read("x", torch.empty(100))
    with pytest.raises(OffloadIOError, match=r"read of .*x\.swp.*Input/output error"):
        handle.wait()
    sw.close()


def test_preflight(tmp_path, monkeypatch) -> None:
    assert check_nvme_path(str(tmp_path), 1, "k") == str(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        check_nvme_path(str(tmp_path / "missing"), 1, "k")
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="not a directory"):
        check_nvme_path(str(tmp_path / "f"), 1, "k")
    with pytest.raises(ConfigError, match="not writable"):
        check_nvme_path("/sys", 1, "k")
    monkeypatch.setattr(preflight, "free_bytes", lambda p: 10 << 30)
    with pytest.raises(ConfigError, match=r"10.00 GiB free but offload needs 21.00 GiB"):
        check_nvme_path(str(tmp_path), 20 << 30, "k")
    assert os.listdir(tmp_path) == ["f"]  # the probe file is gone


@pytest.mark.parametrize("decoupled", [True, False])
def test_flat_adam_equals_torch(decoupled: bool) -> None:
    torch.manual_seed(0)
    p = torch.randn(1000)
    ref = p.clone().requires_grad_(True)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([ref], lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    m, v, step = torch.zeros(1000), torch.zeros(1000), torch.zeros(())
    for _ in range(5):
        g = torch.randn(1000)
        ref.grad = g.clone()
        opt.step()
        adam_step_flat(p, g, m, v, step, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1,
                       adamw_mode=decoupled)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)
    assert float(step) == 5
    assert kernel_for(opt).name == ("adamw" if decoupled else "adam")


def test_offload_config_sections() -> None:
    cfg = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "NVMe", "nvme_path": "/x", "pin_memory": True}},
        "aio": {"thread_count": 4, "block_size": 262144}}, 2)
    off = cfg.zero_optimization.offload_optimizer
    assert off.device == "nvme" and off.enabled and off.buffer_count == 4
    assert cfg.aio.intra_op_parallelism == 4 and cfg.aio.queue_depth == 8
    assert not load_config({"train_batch_size": 8}, 2).zero_optimization.offload_optimizer.enabled
    bad = [({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "needs nvme_path"),
           ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, "device"),
           ({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x", "ratio": 0.3}}},
            "partial offload.*nvme"),
           ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 1.5}}}, "ratio"),
           ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "buffer_cnt": 3}}}, "buffer_count"),
           ({"aio": {"use_gds": True}}, "GPUDirect"),
           ({"aio": {"block_size": 1000}}, "multiple of 4096")]
    for extra, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            load_config({"train_batch_size": 8, **extra}, 2)
    with pytest.raises(ConfigError, match="offload_param.*needs nvme_path"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, 2)
    par = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": "/x", "buffer_count": 2, "max_in_cpu": 0}}}, 2).zero_optimization.offload_param
    assert par.enabled and par.nvme_path == "/x" and par.buffer_count == 2 and par.max_in_cpu == 0
    # DeepSpeed's deprecated alias (tests/unit/test_config.py covers it fully)
    alias = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": True}}, 2)
    assert alias.zero_optimization.offload_optimizer.device == "cpu"


def test_report_command_measures_a_directory(tmp_path, capsys) -> None:
    import json

    from zerospeed.launcher import cli

    assert cli.main(["report", "--nvme_path", str(tmp_path), "--size_mb", "8", "--block_sizes", "1048576",
                     "--threads", "1", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["environment"]["fused_cpu_adam"] is True
    assert lines[1]["label"].startswith("raw") and lines[2]["read_mb_s"] > 0
    assert lines[-1]["suggested"]["aio"]["block_size"] == 1048576
    assert os.listdir(tmp_path) == []
    assert cli.main(["report", "--nvme_path", str(tmp_path / "missing")]) == 2


def test_queue_depth_bounds_the_requests_in_flight(tmp_path, monkeypatch) -> None:
    """aio.queue_depth: never more requests handed to the workers than the depth, however many are queued;
    with slow requests and more threads than the depth, the depth (not the threads) is what runs at once."""
    import time

    from zerospeed.offload import swapper

    real = swapper._pwrite

    def slow(fd: int, buf: memoryview, offset: int) -> int:
        time.sleep(0.05)
        return real(fd, buf, offset)

    monkeypatch.setattr(swapper, "_pwrite", slow)
    for depth in (2, 8):
        sw = AsyncSwapper(str(tmp_path), block_size=4096, threads=4, queue_depth=depth)
        src = aligned_empty(16 * 4096)
        src.random_(0, 255)
        sw.write("q", src).wait()  # 16 requests queued at once
        assert sw.max_in_flight == depth
        assert sw.requests.max_running <= min(4, depth)
        back = aligned_empty(16 * 4096)
        sw.read("q", back).wait()
        assert torch.equal(back, src) and sw.max_in_flight == depth
        sw.close()
    with pytest.raises(ValueError, match="queue_depth"):
        AsyncSwapper(str(tmp_path), queue_depth=0)


def test_queue_depth_comes_from_the_aio_section(tmp_path) -> None:
    from zerospeed.config.offload import AioConfig, OffloadParamConfig
    from zerospeed.offload.param_home import ParamHome

    home = ParamHome(OffloadParamConfig(device="nvme", nvme_path=str(tmp_path)), AioConfig(queue_depth=3), 0)
    assert home.swapper is not None and home.swapper.requests.depth == 3
    home.close()


def test_a_read_of_a_file_being_written_is_refused(tmp_path, monkeypatch) -> None:
    """No silent stale read: while a write of a file is in flight, reads and other writes of it raise."""
    import threading

    from zerospeed.offload import swapper

    gate = threading.Event()
    real = swapper._pwrite

    def gated(fd: int, buf: memoryview, offset: int) -> int:
        gate.wait(10)
        return real(fd, buf, offset)

    sw = AsyncSwapper(str(tmp_path), block_size=4096)
    old = torch.zeros(2048)
    sw.write("w", old).wait()
    monkeypatch.setattr(swapper, "_pwrite", gated)
    new = torch.ones(2048)
    handle = sw.write("w", new)
    for attempt in (lambda: sw.read("w", torch.empty(2048)), lambda: sw.read_range("w", 0, torch.empty(4)),
                    lambda: sw.write("w", new), lambda: sw.write_range("w", 0, torch.ones(4))):
        with pytest.raises(OffloadIOError, match=r"w\.swp.*write of this file is still in flight"):
            attempt()
    gate.set()
    handle.wait()
    back = torch.empty(2048)
    sw.read("w", back).wait()
    assert torch.equal(back, new)
    sw.read("w", back)  # concurrent reads of one file are fine; a write while one is in flight is not
    sw.read("w", torch.empty(2048)).wait()
    sw.close()


@pytest.mark.parametrize("nbytes", [5000, 4096 + 4, 100])
def test_direct_reads_never_write_past_the_target(tmp_path, nbytes: int) -> None:
    """A target whose size is not a multiple of 4 KiB, inside a larger aligned buffer: O_DIRECT moves whole
    pages, but the bytes after the target (a sentinel tail) stay untouched, on read as on write."""
    sw = AsyncSwapper(str(tmp_path), block_size=4096)
    assert sw.direct
    src_buf = aligned_empty(3 * 4096)
    src_buf.fill_(0xCD)  # junk after the source: must not reach the file, nor the reader's memory
    src_buf[:nbytes].random_(0, 200)
    sw.write("t", src_buf[:nbytes]).wait()
    dst_buf = aligned_empty(3 * 4096)
    dst_buf.fill_(0xAB)
    sw.read("t", dst_buf[:nbytes]).wait()
    assert torch.equal(dst_buf[:nbytes], src_buf[:nbytes])
    assert bool((dst_buf[nbytes:] == 0xAB).all()), "a direct read wrote past the end of its target"
    with open(sw.path("t"), "rb") as f:
        assert 0xCD not in f.read()[nbytes:]
    sw.close()


def test_preflight_small_sizes_are_readable(tmp_path, monkeypatch) -> None:
    """Issue 31, item 14: not '0.00 GiB free but needs 0.00 GiB'."""
    monkeypatch.setattr(preflight, "free_bytes", lambda p: 1000)
    with pytest.raises(ConfigError, match=r"has 1000 B free but offload needs 2\.6 MiB"):
        check_nvme_path(str(tmp_path), 5 << 19, "k")
