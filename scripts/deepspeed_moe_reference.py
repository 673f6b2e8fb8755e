"""Regenerate tests/unit/fixtures/deepspeed_moe_gating.json from DeepSpeed's own gating functions.

Run with a Python that has DeepSpeed installed (0.19.8 was used), on CPU:
    DS_ACCELERATOR=cpu python scripts/deepspeed_moe_reference.py
Each case stores its inputs (logits, arguments, RNG seed) and DeepSpeed's outputs.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def _logits(seed: int, s: int, e: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(s, e, generator=g) * 2).round(decimals=3)


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip a ~3 min JIT build
    deepspeed.init_distributed("gloo")
    assert dist.is_initialized()
    from deepspeed.moe import sharded_moe as sm

    cases = []

    def add(name, fn, logits, seed, **kw):
        torch.manual_seed(seed)
        out = getattr(sm, fn)(logits.clone(), **kw)
        l_aux, combine, dispatch, counts = out
        kw_json = {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        cases.append({"name": name, "fn": fn, "seed": seed, "logits": logits.tolist(), "kwargs": kw_json,
                      "l_aux": float(l_aux), "combine": combine.tolist(), "dispatch": dispatch.tolist(),
                      "exp_counts": counts.tolist()})

    lg = _logits(0, 12, 4)
    add("top1_norts", "top1gating", lg, 1, capacity_factor=1.0, min_capacity=2, use_rts=False)
    add("top1_rts", "top1gating", lg, 2, capacity_factor=1.0, min_capacity=2, use_rts=True)
    add("top1_small_cap", "top1gating", lg, 3, capacity_factor=0.5, min_capacity=1, use_rts=True)
    add("top1_rsample", "top1gating", lg, 4, capacity_factor=1.0, min_capacity=2, use_rts=False,
        noisy_gate_policy="RSample")
    add("top1_nodrop", "top1gating", lg, 5, capacity_factor=1.0, min_capacity=2, drop_tokens=False, use_rts=False)
    used = torch.tensor([1, 1, 0, 1, 0, 1, 1, 1, 0, 1, 1, 1], dtype=torch.int64)
    add("top1_used_token", "top1gating", lg, 6, capacity_factor=1.0, min_capacity=2, used_token=used, use_rts=False)
    lg2 = _logits(1, 10, 4)
    add("top2_nosample", "top2gating", lg2, 7, capacity_factor=1.0, min_capacity=1, top2_2nd_expert_sampling=False)
    add("top2_sample", "top2gating", lg2, 8, capacity_factor=1.0, min_capacity=1, top2_2nd_expert_sampling=True)
    add("top2_small_cap", "top2gating", lg2, 9, capacity_factor=0.5, min_capacity=1, top2_2nd_expert_sampling=False)
    add("top2_nodrop", "top2gating", lg2, 10, capacity_factor=1.0, min_capacity=1, drop_tokens=False,
        top2_2nd_expert_sampling=False)
    lg3 = _logits(2, 9, 5)
    add("topk3_probs", "topkgating", lg3, 11, k=3, capacity_factor=0.5, min_capacity=1, drop_policy="probs")
    add("topk3_position", "topkgating", lg3, 12, k=3, capacity_factor=0.5, min_capacity=1, drop_policy="position")
    add("topk3_nodrop", "topkgating", lg3, 13, k=3, capacity_factor=0.5, min_capacity=1, drop_tokens=False)
    add("topk2_generic", "topkgating", lg2, 14, k=2, capacity_factor=1.0, min_capacity=1)

    torch.manual_seed(15)
    jx = _logits(3, 6, 4)
    jit = sm.multiplicative_jitter(jx, device=jx.device)
    torch.manual_seed(16)
    gum = sm.gumbel_rsample((5, 3), device=torch.device("cpu"))
    from deepspeed.moe.layer import MoE

    layers = []
    for name, kw in [("moe_k1", dict(k=1, capacity_factor=0.5, min_capacity=1, use_rts=False)),
                     ("moe_k2", dict(k=2, capacity_factor=0.75, min_capacity=1, top2_2nd_expert_sampling=False)),
                     ("moe_k3_residual", dict(k=3, capacity_factor=1.0, min_capacity=1, use_residual=True))]:
        torch.manual_seed(20)
        expert = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.GELU(), torch.nn.Linear(10, 6))
        moe = MoE(6, expert, num_experts=4, **kw)
        moe.set_deepspeed_parallelism()
        x = torch.randn(3, 4, 6, requires_grad=True)
        y, l_aux, counts = moe(x)
        w = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
        ((y * w).sum() + l_aux).backward()
        layers.append({"name": name, "kwargs": kw, "state": {k: v.tolist() for k, v in moe.state_dict().items()},
                       "x": x.detach().tolist(), "y": y.detach().tolist(), "l_aux": float(l_aux.detach()),
                       "exp_counts": counts.tolist(), "x_grad": x.grad.tolist(),
                       "wg_grad": moe.deepspeed_moe.gate.wg.weight.grad.tolist()})
    out = {"layers": layers, "deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__, "cases": cases,
           "jitter": {"seed": 15, "x": jx.tolist(), "out": jit.tolist()},
           "gumbel": {"seed": 16, "shape": [5, 3], "out": gum.tolist()}}
    path = os.path.join(os.path.dirname(__file__), "..", "tests", "unit", "fixtures", "deepspeed_moe_gating.json")
    with open(path, "w") as f:
        json.dump(out, f)
    print(f"wrote {len(cases)} cases to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
