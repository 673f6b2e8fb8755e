"""Dynamic batching (``data_efficiency.data_sampling.dynamic_batching``): the packing and the LR scaling give
DeepSpeed's numbers. Every expected value below was produced by DeepSpeed 0.19.8's own
``variable_batch_size_and_lr.py`` (``/work/venv-ds``, a one-off script) on the same inputs."""

from __future__ import annotations

import math

import pytest
import torch

from zerospeed.config import load_config
from zerospeed.config.errors import ConfigError
from zerospeed.data_pipeline import (batch_by_seqlens, dataloader_for_variable_batch_size,
                                     lr_scheduler_for_variable_batch_size, scale_lr)
from zerospeed.data_pipeline.dynamic_batching import dataset_seqlens_from

SEQ = [21, 10, 26, 4, 5, 35, 7, 24, 38, 4, 33, 14, 3, 6, 28, 27, 5, 16, 6, 36, 28, 4, 37, 8]

# (arguments, microbatch_ids, batch_sizes, batch_max_seqlens) from DeepSpeed 0.19.8
PINNED = [
    (dict(max_tokens=40, effective_batch_size=2),
     [(0, [0, 1]), (0, [2, 3, 4]), (1, [5]), (1, [6, 7]), (2, [8]), (2, [9, 10]), (3, [11, 12, 13]), (3, [14]),
      (4, [15, 16]), (4, [17, 18]), (5, [19]), (5, [20, 21])], [5, 3, 3, 4, 4, 3], [26, 35, 38, 28, 27, 36]),
    (dict(max_tokens=40, effective_batch_size=2, sequence_picking_order="seqlen"),
     [(0, [12, 3, 9, 21, 4, 16, 13, 18]), (0, [6, 23, 1, 11]), (1, [17, 0]), (1, [7]), (2, [2]), (2, [15]), (3, [14]),
      (3, [20]), (4, [10]), (4, [5]), (5, [19]), (5, [22])], [12, 3, 2, 2, 2, 2], [14, 24, 27, 28, 35, 37]),
    (dict(max_tokens=40, effective_batch_size=2, sequence_picking_order="random", seed=1234),
     [(0, [17, 4, 23]), (0, [10, 6]), (1, [15]), (1, [19]), (2, [8]), (2, [7, 9]), (3, [5, 12]), (3, [13, 21, 16, 11]),
      (4, [22]), (4, [20, 1]), (5, [18, 2]), (5, [0, 3])], [5, 2, 3, 6, 3, 4], [33, 36, 38, 35, 37, 26]),
    (dict(max_tokens=45, effective_batch_size=2, min_batch_size=2, max_batch_size=3),
     [(0, [0, 1]), (0, [2, 3, 4])], [5], [26]),
    (dict(max_tokens=60, effective_batch_size=2, required_microbatches_of_same_size=True),
     [(0, [0, 2, 4]), (0, [1, 3, 5]), (1, [6, 8]), (1, [7, 9]), (2, [10, 12]), (2, [11, 13]), (3, [14, 16]),
      (3, [15, 17]), (4, [18, 20]), (4, [19, 21])], [6, 4, 4, 4, 4], [35, 38, 33, 28, 36]),
    (dict(max_tokens=30, effective_batch_size=2, sequence_ids_per_mb=list(range(0, 24, 2))),
     [(0, [0]), (0, [2]), (1, [4, 6, 12]), (1, [14])], [2, 4], [26, 28]),
]


@pytest.mark.parametrize("args,microbatches,sizes,longest", PINNED)
def test_packing_gives_deepspeeds_batches(args, microbatches, sizes, longest) -> None:
    got, got_sizes, got_longest = batch_by_seqlens(SEQ, **args)
    assert [(b, list(ids)) for b, ids in got] == microbatches
    assert got_sizes == sizes and got_longest == longest


def test_packing_refuses_too_few_samples_and_negative_lengths() -> None:
    with pytest.raises(ValueError, match="fewer than the 4"):
        batch_by_seqlens([10, 10, 10], max_tokens=10, effective_batch_size=4)
    with pytest.raises(ValueError, match="non-negative"):
        batch_by_seqlens([3, -1, 2, 2], max_tokens=10)


def test_scale_lr_rules() -> None:
    assert scale_lr(8, 5, 0.1, "linear") == pytest.approx(0.1 * 5 / 8)
    assert scale_lr(8, 5, 0.1, "sqrt") == pytest.approx(0.1 * math.sqrt(5 / 8))
    assert scale_lr(8, 5, 0.1, "none") == scale_lr(8, 5, 0.1, None) == 0.1
    with pytest.raises(ValueError, match="Unknown scaling method"):
        scale_lr(8, 5, 0.1, "cubic")


# DeepSpeed 0.19.8: the optimizer's two groups' LRs at construction and after each of 4 steps, batch sizes
# [5, 3, 3, 4, 4, 3] of the first PINNED case, reference batch size 2.
LRS = {
    ("lambda", "linear"): [[0.25, 0.05], [0.075, 0.015], [0.05, 0.01], [0.05, 0.01], [0.04, 0.008]],
    ("lambda", "sqrt"): [[0.158113883008419, 0.0316227766016838], [0.06123724356957945, 0.01224744871391589],
                         [0.0408248290463863, 0.00816496580927726], [0.03535533905932738, 0.007071067811865476],
                         [0.02828427124746191, 0.005656854249492381]],
    ("optimizer", "linear"): [[0.25, 0.05], [0.15, 0.03], [0.15, 0.03], [0.2, 0.04], [0.2, 0.04]],
    ("optimizer", "sqrt"): [[0.158113883008419, 0.0316227766016838], [0.1224744871391589, 0.02449489742783178],
                            [0.1224744871391589, 0.02449489742783178], [0.14142135623730953, 0.028284271247461905],
                            [0.14142135623730953, 0.028284271247461905]],
}


@pytest.mark.parametrize("kind,method", sorted(LRS))
def test_lr_scheduler_gives_deepspeeds_learning_rates(kind: str, method: str) -> None:
    _, sizes, _ = batch_by_seqlens(SEQ, max_tokens=40, effective_batch_size=2)
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.SGD([{"params": [params[0]], "lr": 0.1}, {"params": [params[1]], "lr": 0.02}])
    base = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if kind == "lambda" else opt
    sched = lr_scheduler_for_variable_batch_size(2, sizes, None, base, method)
    seen = [[g["lr"] for g in opt.param_groups]]
    for _ in range(4):
        opt.step()
        sched.step()
        seen.append([g["lr"] for g in opt.param_groups])
    flat = [lr for row in LRS[(kind, method)] for lr in row]
    assert [lr for row in seen for lr in row] == pytest.approx(flat, rel=1e-12)
    assert sched.get_last_lr() == pytest.approx([0.02, 0.004] if kind == "lambda" else [0.1, 0.02])
    state = sched.state_dict()
    assert state["last_epoch"] == 4 and state["batch_sizes"] == sizes
    with pytest.raises(ValueError, match="Unknown type"):
        lr_scheduler_for_variable_batch_size(2, sizes, None, object())


def test_loader_interleaves_microbatches_over_replicas_and_pads_for_pipelines() -> None:
    microbatches, _, longest = batch_by_seqlens(SEQ, max_tokens=40, effective_batch_size=2)
    data = [list(range(n)) for n in SEQ]
    loader, kwargs = dataloader_for_variable_batch_size(data, microbatches, longest, dataloader_rank=1,
                                                        dataloader_batch_size=2, dataloader_num_replicas=2,
                                                        dataloader_num_workers=0,
                                                        dataloader_collate_fn=lambda s: [len(x) for x in s])
    # replica 1 takes micro-batches 1, 3, 5, ... two per step: samples (2,3,4)+(6,7), then (9,10)+(14), ...
    assert next(iter(loader)) == [SEQ[i] for i in (2, 3, 4, 6, 7)]
    assert len(loader) == 3 and kwargs["batch_size"] == 2 and kwargs["num_local_io_workers"] == 0
    padded, _ = dataloader_for_variable_batch_size(data, microbatches, longest, dataloader_num_workers=0,
                                                   required_microbatches_of_same_seqlen=True,
                                                   sample_padding_fn=lambda s, n: s + [0] * (n - len(s)))
    assert [len(s) for s in next(iter(padded))] == [26, 26]
    with pytest.raises(ValueError, match="sample_padding_fn"):
        dataloader_for_variable_batch_size(data, microbatches, longest, required_microbatches_of_same_seqlen=True)


def test_config_section_and_seqlen_metric_files(tmp_path) -> None:
    cfg = load_config({"train_batch_size": 2, "data_efficiency": {"data_sampling": {"dynamic_batching": {
        "enabled": True, "max_tokens": 40, "lr_scaling_method": "sqrt", "metrics_path": str(tmp_path)}}}})
    section = cfg.data_efficiency.data_sampling.dynamic_batching
    assert (section.max_tokens, section.lr_scaling_method, section.min_batch_size) == (40, "sqrt", 1)
    assert section.sequence_picking_order == "dataloader" and section.max_batch_size is None
    with pytest.raises(ConfigError, match="max_tokens"):
        load_config({"train_batch_size": 2, "data_efficiency": {"data_sampling": {"dynamic_batching": {
            "enabled": True}}}})
    with pytest.raises(ConfigError, match="max_token"):
        load_config({"train_batch_size": 2, "data_efficiency": {"data_sampling": {"dynamic_batching": {
            "enabled": True, "max_token": 40}}}})
    data = [list(range(n)) for n in SEQ]
    with pytest.raises(ValueError, match="batch_seqlens_fn"):
        dataset_seqlens_from(data, str(tmp_path), None, None, write=True)
    written = dataset_seqlens_from(data, str(tmp_path), lambda batch: [len(s) for s in batch], None, write=True)
    assert list(written) == SEQ
    assert list(dataset_seqlens_from(data, str(tmp_path), None, None, write=False)) == SEQ  # read back
    with pytest.raises(ValueError, match="delete the metrics_path"):
        dataset_seqlens_from(data[:5], str(tmp_path), None, None, write=False)
