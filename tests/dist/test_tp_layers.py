"""Column- and row-parallel linear layers on real Gloo ranks (tp 2 and 4): outputs and weight/bias/input
gradients equal the matching slices of the unsplit layer — even and uneven shards, with and without the
overlapped input-gradient all-reduce, with and without sequence parallelism, with gather_output."""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

from zerospeed import comm
from zerospeed.module_inject.layers import LinearAllreduce, LinearLayer
from zerospeed.parallel.tensor import shard
from zerospeed.testing import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)


def _cut(sizes: tuple[int, ...], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _data(b: int, s: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(b, s, n, generator=torch.Generator().manual_seed(seed))


def _column(group, rank: int, tp: int, d_in: int, d_out: int, overlap: bool, sp: bool, gather: bool) -> None:
    torch.manual_seed(0)
    col = LinearLayer(nn.Linear(d_in, d_out), group, gather_output=gather, overlap_comm=overlap,
                      sequence_parallel=sp, name="col")
    torch.manual_seed(0)
    full = nn.Linear(d_in, d_out)
    me = _cut(col.partition_sizes, rank)
    assert torch.equal(col.weight, full.weight[me]) and torch.equal(col.bias, full.bias[me])
    b, s = 2, 4
    x_full = _data(b, s, d_in, 1).requires_grad_()
    probe = _data(b, s, d_out, 2)
    y_full = full(x_full)
    (y_full * probe).sum().backward()
    seq = slice(rank * s // tp, (rank + 1) * s // tp)
    x = (x_full.detach()[:, seq] if sp else x_full.detach()).clone().requires_grad_()
    y = col(x)
    seen: list[tuple[str, bool]] = []   # (collective, async) of the backward's input-gradient collective
    real = {name: getattr(comm, name) for name in ("all_reduce", "reduce_scatter_along_dim")}
    for name, fn in real.items():
        setattr(comm, name, lambda *a, _n=name, _f=fn, **k: seen.append((_n, k.get("async_op", False))) or _f(*a, **k))
    try:
        if gather:
            torch.testing.assert_close(y, y_full, **TOL)
            (y * probe).sum().backward()
        else:
            torch.testing.assert_close(y, y_full[..., me], **TOL)
            (y * probe[..., me]).sum().backward()
    finally:
        for name, fn in real.items():
            setattr(comm, name, fn)
    assert seen == [("reduce_scatter_along_dim" if sp else "all_reduce", overlap)], seen
    torch.testing.assert_close(col.weight.grad, full.weight.grad[me], **TOL)
    torch.testing.assert_close(col.bias.grad, full.bias.grad[me], **TOL)
    torch.testing.assert_close(x.grad, x_full.grad[:, seq] if sp else x_full.grad, **TOL)


def _row(group, rank: int, tp: int, d_in: int, d_out: int, sp: bool, replicated_input: bool) -> None:
    torch.manual_seed(0)
    row = LinearAllreduce(nn.Linear(d_in, d_out), group, sequence_parallel=sp, name="row",
                          input_is_parallel=not replicated_input)
    torch.manual_seed(0)
    full = nn.Linear(d_in, d_out)
    me = _cut(row.partition_sizes, rank)
    assert torch.equal(row.weight, full.weight[:, me]) and torch.equal(row.bias, full.bias)
    b, s = 2, 4
    x_full = _data(b, s, d_in, 3).requires_grad_()
    probe = _data(b, s, d_out, 4)
    y_full = full(x_full)
    (y_full * probe).sum().backward()
    seq = slice(rank * s // tp, (rank + 1) * s // tp) if sp else slice(None)
    x = (x_full.detach() if replicated_input else x_full.detach()[..., me]).clone().requires_grad_()
    y = row(x)
    torch.testing.assert_close(y, y_full[:, seq], **TOL)
    (y * probe[:, seq]).sum().backward()
    torch.testing.assert_close(row.weight.grad, full.weight.grad[:, me], **TOL)
    torch.testing.assert_close(row.bias.grad, full.bias.grad, **TOL)
    if replicated_input:  # each rank's input grad is partial in its own features: the mapping all-gathers
        torch.testing.assert_close(x.grad, x_full.grad, **TOL)
    else:
        torch.testing.assert_close(x.grad, x_full.grad[..., me], **TOL)


def _conv1d(group, rank: int, tp: int, sp: bool) -> None:
    """Hugging Face Conv1D (GPT-2; weight stored [in, out]): c_fc column, c_proj row, shapes kept."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    fc_full, proj_full = Conv1D(12, 8), Conv1D(8, 12)      # Conv1D(nf=out, nx=in)
    for p in (*fc_full.parameters(), *proj_full.parameters()):
        p.data.normal_()
    fc = LinearLayer(copy.deepcopy(fc_full), group, sequence_parallel=sp, name="mlp.c_fc")
    proj = LinearAllreduce(copy.deepcopy(proj_full), group, sequence_parallel=sp, name="mlp.c_proj")
    me = _cut(fc.partition_sizes, rank)
    assert torch.equal(fc.weight, fc_full.weight[:, me]) and torch.equal(proj.weight, proj_full.weight[me])
    x_full = _data(2, 4, 8, 5)
    probe = _data(2, 4, 8, 6)
    (proj_full(torch.tanh(fc_full(x_full))) * probe).sum().backward()
    seq = slice(rank * 4 // tp, (rank + 1) * 4 // tp) if sp else slice(None)
    y = proj(torch.tanh(fc(x_full[:, seq])))
    torch.testing.assert_close(y, proj_full(torch.tanh(fc_full(x_full)))[:, seq], **TOL)
    (y * probe[:, seq]).sum().backward()
    for layer, full in ((fc, fc_full), (proj, proj_full)):
        for attr, spec in layer.shard_specs().items():
            torch.testing.assert_close(getattr(layer, attr).grad, shard(getattr(full, attr).grad, spec, rank), **TOL)
        for attr, whole in layer.gathered_parameters().items():   # [in, out] as Conv1D stores it
            assert torch.equal(whole, getattr(full, attr).detach()), attr


def _all_cases() -> int:
    rank, tp = comm.get_rank(), comm.get_world_size()
    group = comm.world_group()
    n = 0
    for (d_in, d_out), overlap, sp, gather in itertools.product([(8, 12), (10, 6)], [False, True], [False, True],
                                                                [False, True]):
        _column(group, rank, tp, d_in, d_out, overlap, sp, gather)
        n += 1
    for (d_in, d_out), sp, repl in itertools.product([(12, 8), (10, 6)], [False, True], [False, True]):
        _row(group, rank, tp, d_in, d_out, sp, repl)
        n += 1
    for sp in (False, True):
        _conv1d(group, rank, tp, sp)
        n += 1
    return n


def test_layers_tp2() -> None:
    assert run_distributed(_all_cases, 2, timeout=90) == [26, 26]


def test_layers_tp4() -> None:
    assert run_distributed(_all_cases, 4, timeout=120) == [26] * 4


def _no_group() -> dict:
    """``mp_group=None`` is a tensor-parallel size of 1 even in a 2-rank world: no collective at all."""
    comm.COMMS_LOGGER.reset()
    torch.manual_seed(comm.get_rank())   # different weights per rank: any all-reduce would show
    lin = nn.Linear(4, 6)
    col = LinearLayer(copy.deepcopy(lin), None, gather_output=True, overlap_comm=True, sequence_parallel=True)
    row = LinearAllreduce(nn.Linear(6, 4), None, sequence_parallel=True)
    x = _data(2, 4, 4, 0).requires_grad_()
    y = row(col(x))
    y.sum().backward()
    torch.testing.assert_close(col(x), lin(x), rtol=0, atol=0)
    return {op: s.count for op, s in comm.COMMS_LOGGER.snapshot().items() if s.count}


def test_no_group_never_communicates() -> None:
    assert run_distributed(_no_group, 2, timeout=60) == [{}, {}]
