"""``deepspeed.runtime.utils``' gradient helpers and ``deepspeed.utils.groups``' expert groups across real ranks
(Gloo): an inf in one rank's expert gradient is every rank's overflow, a dense one stays local (DeepSpeed's
rule: dense gradients are all-reduced anyway); ``clip_grad_norm_`` clips every rank by the mean of the ranks'
norms; ``deepspeed.comm.all_gather`` takes torch's list form."""

from __future__ import annotations

import math

import torch

from zerospeed import comm
from zerospeed.runtime import utils as ds_utils
from zerospeed.testing import run_distributed
from zerospeed.utils import groups


def _param(value: float, expert: bool = False) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.tensor([value])
    if expert:
        p.allreduce = False  # an expert's parameter, as ``Experts`` tags it
    return p


def _overflow_and_groups() -> dict:
    rank = comm.get_rank()
    groups._create_expert_and_data_parallel(2)
    groups._create_expert_and_data_parallel(2)  # made once
    out = {"max": groups._get_max_expert_size(), "ep": groups._get_expert_parallel_group_ranks("ep_size_2"),
           "edp": groups._get_expert_data_parallel_group_ranks("ep_size_2"),
           "ep_rank": groups._get_expert_parallel_rank("ep_size_2"),
           "edp_size": groups._get_expert_data_parallel_world_size("ep_size_2")}
    bad = float("inf") if rank == 1 else 1.0
    expert_params = [_param(1.0), _param(bad, expert=True)]
    out["expert"] = ds_utils.CheckOverflow([expert_params]).check()
    norm = ds_utils.get_weight_norm([p.grad for p in expert_params])
    out["expert_norm"] = ds_utils.CheckOverflow([expert_params]).check_using_norm([norm], reduce_overflow=False)
    out["dense"] = ds_utils.CheckOverflow([[_param(1.0), _param(bad)]]).check()
    out["reduced"] = ds_utils.CheckOverflow().check_using_norm([norm], reduce_overflow=True)
    return out


def test_expert_groups_and_overflow_across_ranks() -> None:
    r0, r1 = run_distributed(_overflow_and_groups, world_size=2)
    assert r0["max"] == r1["max"] == 2 and r0["ep"] == r1["ep"] == [0, 1]
    assert (r0["edp"], r1["edp"], r0["ep_rank"], r1["ep_rank"], r0["edp_size"]) == ([0], [1], 0, 1, 1)
    assert r0["expert"] and r1["expert"] and r0["expert_norm"] and r1["expert_norm"]
    assert (r0["dense"], r1["dense"]) == (False, True)  # dense: this rank's own verdict
    assert r0["reduced"] and r1["reduced"]


def _clip() -> dict:
    rank = comm.get_rank()
    groups._create_expert_and_data_parallel(2)
    params = [_param(1.0), _param(float(rank + 1), expert=True)]
    local = math.sqrt(1.0 + (rank + 1.0) ** 2)
    norm = ds_utils.clip_grad_norm_(params, max_norm=0.1)
    gathered = [torch.zeros(1) for _ in range(comm.get_world_size())]
    comm.all_gather(gathered, torch.tensor([local]))  # torch's list form
    return {"norm": float(norm), "locals": [float(t) for t in gathered], "grads": [float(p.grad) for p in params]}


def test_clip_grad_norm_clips_every_rank_by_the_mean_norm() -> None:
    r0, r1 = run_distributed(_clip, world_size=2)
    locals_ = [math.sqrt(2.0), math.sqrt(5.0)]
    assert r0["locals"] == r1["locals"] and all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(r0["locals"], locals_))
    mean = sum(locals_) / 2
    assert math.isclose(r0["norm"], mean, rel_tol=1e-6) and r0["norm"] == r1["norm"]
    coef = 0.1 / (mean + 1e-6)
    for rank, r in enumerate((r0, r1)):
        assert all(math.isclose(g, want * coef, rel_tol=1e-5) for g, want in zip(r["grads"], [1.0, rank + 1.0]))
