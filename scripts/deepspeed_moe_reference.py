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
    dist.init_process_group("gloo", rank=0, world_size=1)
    import deepspeed
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
    x = _logits(3, 6, 4)
    jit = sm.multiplicative_jitter(x, device=x.device)
    torch.manual_seed(16)
    gum = sm.gumbel_rsample((5, 3), device=torch.device("cpu"))
    out = {"deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__, "cases": cases,
           "jitter": {"seed": 15, "x": x.tolist(), "out": jit.tolist()},
           "gumbel": {"seed": 16, "shape": [5, 3], "out": gum.tolist()}}
    path = os.path.join(os.path.dirname(__file__), "..", "tests", "unit", "fixtures", "deepspeed_moe_gating.json")
    with open(path, "w") as f:
        json.dump(out, f)
    print(f"wrote {len(cases)} cases to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
