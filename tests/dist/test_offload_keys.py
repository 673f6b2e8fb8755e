"""Every accepted offload key has its effect (DeepSpeed's meaning): ``offload_param.buffer_count`` x
``buffer_size`` bound the parameter read-ahead, ``max_in_cpu`` the elements kept on the host;
``offload_optimizer.buffer_count`` is the number of stream buffers (``buffer_count - 2`` sub-groups read
ahead); ``aio.block_size``, ``queue_depth`` and ``intra_op_parallelism`` (or ``thread_count``) configure both
swappers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .parity import make_model, micro_batch, param_groups


def _engine(zero: dict[str, Any], aio: dict[str, Any] | None = None) -> tuple[Any, Any]:
    import zerospeed

    model = make_model()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"reduce_bucket_size": 200, "sub_group_size": 64, **zero}, "steps_per_print": 1000}
    if aio is not None:
        config["aio"] = aio
    engine, opt, _, _ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine, opt


def _train(engine: Any, steps: int) -> None:
    for step in range(steps):
        x, y = micro_batch(step, 0, 0, 1, 2, 1)
        engine.backward(engine(x, y))
        engine.step()


def _param_offload(path: str, buffer_count: int, buffer_size: int, max_in_cpu: int) -> dict[str, Any]:
    engine, opt = _engine({"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                           "stage3_prefetch_bucket_size": 0,  # disk read-ahead alone (gather prefetch loads its window)
                           "offload_param": {"device": "nvme", "nvme_path": path, "buffer_count": buffer_count,
                                             "buffer_size": buffer_size, "max_in_cpu": max_in_cpu}})
    home = engine.zero3.param_home
    ahead: list[int] = []
    real = home.prefetch

    def spy(shards: Any) -> None:
        real(shards)
        ahead.append(sum(home.swapper.sizes[k] // 4 for k in home.pending))

    home.prefetch = spy
    _train(engine, 2)
    out = {"read_ahead": home.read_ahead_numel, "max_ahead": max(ahead), "host_numel": home.host_numel,
           "files": len(home.swapper.sizes), "biggest": max(s.shard for s in engine.zero3.shards)}
    home.close()
    opt.stepper and opt.stepper.close()
    return out


def test_offload_param_buffers_bound_the_read_ahead(tmp_path) -> None:
    small = run_distributed(_param_offload, 1, str(tmp_path), 1, 1, 0, timeout=120)[0]
    large = run_distributed(_param_offload, 1, str(tmp_path), 4, 10**6, 0, timeout=120)[0]
    assert small["read_ahead"] == 1 and large["read_ahead"] == 4 * 10**6
    assert small["max_ahead"] <= 2 * small["biggest"]  # the next unit only (and the one being loaded)
    assert large["max_ahead"] > small["max_ahead"]


def test_offload_param_max_in_cpu_keeps_that_many_elements_on_the_host(tmp_path) -> None:
    none = run_distributed(_param_offload, 1, str(tmp_path), 2, 64, 0, timeout=120)[0]
    some = run_distributed(_param_offload, 1, str(tmp_path), 2, 64, 300, timeout=120)[0]
    assert none["host_numel"] == 0 and 0 < some["host_numel"] <= 300
    assert some["files"] < none["files"]


def _optimizer_offload(path: str, buffer_count: int, aio: dict[str, Any]) -> dict[str, Any]:
    engine, opt = _engine({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": path,
                                                             "buffer_count": buffer_count}}, aio)
    stepper = opt.stepper
    sw, kernel = stepper.swapper, stepper.kernel
    issued, stepped, ahead = [0], [0], []
    real_read = sw.read

    def read(name: str, t: torch.Tensor, offset: int | None = None) -> Any:
        issued[0] += offset is None  # a sub-group's whole file: the stepper's read-ahead
        return real_read(name, t, offset)

    class Counting:
        """The flat kernel, noting how many sub-group reads were started beyond the one it steps."""

        def __getattr__(self, name: str) -> Any:
            return getattr(kernel, name)

        def step(self, *args: Any, **kwargs: Any) -> None:
            stepped[0] += 1
            ahead.append(issued[0] - stepped[0])
            kernel.step(*args, **kwargs)

    sw.read = read
    stepper.kernel = Counting()
    _train(engine, 2)
    out = {"buffers": len(stepper.buffers), "block_size": sw.block_size, "depth": sw.requests.depth,
           "threads": sw.requests.pool._max_workers, "max_ahead": max(ahead),
           "max_in_flight": sw.max_in_flight, "subgroups": sum(len(s) for s in stepper.subgroups)}
    stepper.close()
    return out


@pytest.mark.parametrize("buffer_count", [3, 5])
def test_offload_optimizer_buffer_count_and_aio(buffer_count: int, tmp_path) -> None:
    aio = {"block_size": 8192, "queue_depth": 2, "thread_count": 3}
    r = run_distributed(_optimizer_offload, 1, str(tmp_path), buffer_count, aio, timeout=120)[0]
    assert r["subgroups"] > buffer_count
    assert r["buffers"] == buffer_count
    assert r["max_ahead"] == buffer_count - 2  # sub-group reads started beyond the one being stepped
    assert (r["block_size"], r["depth"], r["threads"]) == (8192, 2, 3)
    assert 1 <= r["max_in_flight"] <= 2
