"""A 2-block Megatron-style transformer (fused GQA QKV, packed gate/up SwiGLU MLP) at tp=2 equals the unsplit
one — outputs, every parameter gradient (sharded ones as their slice) and the input gradient — with and
without sequence parallelism and overlap; with sequence parallelism the LayerNorm region's saved activations,
measured as the bytes autograd keeps, are 1/tp of plain tensor parallelism."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed import comm
from zerospeed.parallel.tensor import (AutoTPMeta, FusedQKVLinear, GateUpPack_LinearLayer, LinearAllreduce,
                                       SequenceParallelGradSync, gather_from_sequence_parallel_region,
                                       scatter_to_sequence_parallel_region, shard, tp_shard_specs)
from zerospeed.testing import run_distributed

H, HEADS, KV, FF, B, S = 16, 4, 2, 24, 2, 8
HD = H // HEADS
TOL = dict(rtol=1e-5, atol=1e-5)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H, (HEADS + 2 * KV) * HD)
        self.proj = nn.Linear(HEADS * HD, H)
        self.heads, self.kv = HEADS, KV   # this rank's head counts (all of them when unsplit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)   # under sequence parallelism x holds seq/tp tokens, qkv all of them
        b, s, _ = qkv.shape
        q, k, v = qkv.split([self.heads * HD, self.kv * HD, self.kv * HD], dim=-1)
        q = q.view(b, s, self.heads, HD).transpose(1, 2)
        k, v = (z.view(b, s, self.kv, HD).transpose(1, 2).repeat_interleave(self.heads // self.kv, 1) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.heads * HD))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Linear(H, 2 * FF)
        self.down = nn.Linear(FF, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(H), Attention(), nn.LayerNorm(H), Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _parallelise(model: nn.Sequential, group, sp: bool, overlap: bool) -> SequenceParallelGradSync | None:
    kw = dict(sequence_parallel=sp)
    for i, blk in enumerate(model):
        attn, mlp = blk.attn, blk.mlp
        attn.qkv = FusedQKVLinear(attn.qkv, group, HEADS, KV, name=f"{i}.attn.qkv", overlap_comm=overlap, **kw)
        attn.heads, attn.kv = attn.qkv.local_heads
        attn.proj = LinearAllreduce(attn.proj, group, name=f"{i}.attn.proj", tp_meta=AutoTPMeta(num_kv_heads=KV), **kw)
        mlp.gate_up = GateUpPack_LinearLayer(mlp.gate_up, group, name=f"{i}.mlp.gate_up", overlap_comm=overlap, **kw)
        mlp.down = LinearAllreduce(mlp.down, group, name=f"{i}.mlp.down", **kw)
    norms = [p for blk in model for p in (*blk.ln1.parameters(), *blk.ln2.parameters())]
    return SequenceParallelGradSync(norms, group) if sp else None


def _saved_ln_bytes(model: nn.Sequential) -> list[int]:
    """Bytes of activations autograd keeps for the LayerNorms (parameters excluded), filled during forward."""
    box: list[int] = [0]
    params = {p.data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            box[0] += t.numel() * t.element_size()
        return t

    for blk in model:
        for ln in (blk.ln1, blk.ln2):
            ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            ln.register_forward_pre_hook(lambda m, a, c=ctx: c.__enter__())
            ln.register_forward_hook(lambda m, a, o, c=ctx: c.__exit__(None, None, None))
    return box


def _run(group, rank: int, tp: int, sp: bool, overlap: bool) -> int:
    torch.manual_seed(0)
    full = nn.Sequential(Block(), Block())
    model = copy.deepcopy(full)
    sync = _parallelise(model, group, sp, overlap)
    x_full = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1)).requires_grad_()
    probe = torch.randn(B, S, H, generator=torch.Generator().manual_seed(2))
    (full(x_full) * probe).sum().backward()
    y_full = full(x_full).detach()
    x = x_full.detach().clone().requires_grad_()
    ln_bytes = _saved_ln_bytes(model)
    inner = scatter_to_sequence_parallel_region(x, group) if sp else x
    y = model(inner)
    y = gather_from_sequence_parallel_region(y, group, tensor_parallel_output_grad=False) if sp else y
    torch.testing.assert_close(y, y_full, **TOL)
    (y * probe).sum().backward()
    torch.testing.assert_close(x.grad, x_full.grad, **TOL)
    specs = tp_shard_specs(model)
    assert "0.attn.qkv.weight" in specs and specs["0.attn.proj.bias"].dim is None
    full_params = dict(full.named_parameters())
    for name, p in model.named_parameters():
        expected = full_params[name].grad
        if name in specs:
            expected = shard(expected, specs[name], rank)
        torch.testing.assert_close(p.grad, expected, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    if sync is not None:
        sync.remove()
    return ln_bytes[0]


def _all() -> dict[str, int]:
    group, rank, tp = comm.world_group(), comm.get_rank(), comm.get_world_size()
    out = {}
    for sp in (False, True):
        for overlap in (False, True):
            out[f"sp={sp},overlap={overlap}"] = _run(group, rank, tp, sp, overlap)
    return out


def test_block_tp2_equals_unsplit_and_sp_divides_ln_activations() -> None:
    results = run_distributed(_all, 2, timeout=120)
    for per_rank in results:
        plain, seq = per_rank["sp=False,overlap=False"], per_rank["sp=True,overlap=False"]
        assert plain > 0 and seq * 2 == plain, per_rank   # measured: LayerNorm activations / tp
