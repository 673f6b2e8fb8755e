"""A hand-written, single-process ZenFlow on the parity model: whole tensors, boolean masks, AdamW written out.

Written from the algorithm's statement (``offload/zenflow/stepper.py`` docstring), not from its code: for
each step the whole global batch, global-norm clipping, then warm-up / select / accumulate / selective step /
host update (optionally one interval stale).
"""

from __future__ import annotations

from typing import Any

import torch

from .parity import global_batch, make_model, param_groups


def adamw(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, lr: float, wd: float,
          b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = v.sqrt() / (1 - b2 ** step) ** 0.5 + eps
    return p - lr / (1 - b1 ** step) * m / denom, m, v


def reference(steps: int, batch: int, clip: float, zf: dict[str, Any]) -> dict[str, Any]:
    warm, k = zf.get("full_warm_up_rounds", 0), zf["topk_ratio"]
    interval, update = zf["select_interval"], zf["update_interval"]
    overlap = zf.get("overlap_step", False)
    model = make_model()
    groups = [(g["params"], g.get("lr", 1e-2), g["weight_decay"]) for g in param_groups(model)]
    trained = [(p, lr, wd) for ps, lr, wd in groups for p in ps if p.requires_grad]
    zeros = lambda: [torch.zeros_like(p) for p, _, _ in trained]  # noqa: E731
    m, v, ms, vs, acc = zeros(), zeros(), zeros(), zeros(), zeros()
    masks = [torch.ones_like(p, dtype=torch.bool) for p, _, _ in trained]
    cpu_copy: list[torch.Tensor] | None = None
    pending = False
    n, sel_step, losses, updates = 0, 0, [], 0

    def apply() -> None:  # a finished (stale) host update reaches every unselected element
        nonlocal pending, updates
        if pending:
            assert cpu_copy is not None
            for (p, _, _), c, s in zip(trained, cpu_copy, masks):
                p.data = torch.where(s, p.data, c)
            pending, updates = False, updates + 1

    for t in range(steps):
        x, y = global_batch(t, batch)
        loss = model(x, y)
        for p in model.parameters():
            p.grad = None
        loss.backward()
        losses.append(loss.item())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p, _, _ in trained]
        total = torch.sqrt(sum((g * g).sum() for g in grads))
        coef = min(1.0, clip / (float(total) + 1e-6))
        grads = [g * coef for g in grads]
        with torch.no_grad():
            if t < warm:
                for j, ((p, lr, wd), g) in enumerate(zip(trained, grads)):
                    p.data, m[j], v[j] = adamw(p.data, g, m[j], v[j], t + 1, lr, wd)
                continue
            if t == warm or (interval and t % interval == 0):  # select
                apply()
                for j, (p, _, _) in enumerate(trained):
                    if p.dim() == 2:
                        sums = grads[j].abs().sum(dim=0)
                        cols = torch.topk(sums, max(1, int(p.shape[1] * k))).indices
                        masks[j] = torch.zeros_like(p, dtype=torch.bool)
                        masks[j][:, cols] = True
                    ms[j].zero_()
                    vs[j].zero_()
                if overlap:
                    cpu_copy = [p.data.clone() for p, _, _ in trained]
            n, sel_step = n + 1, sel_step + 1
            for j, ((p, lr, wd), g) in enumerate(zip(trained, grads)):
                acc[j] += g
                new_p, new_m, new_v = adamw(p.data, g, ms[j], vs[j], sel_step, lr, wd)
                s = masks[j]
                p.data, ms[j], vs[j] = torch.where(s, new_p, p.data), torch.where(s, new_m, ms[j]), torch.where(s, new_v, vs[j])
            if (t + 1 - warm) % update == 0 or (interval and (t + 1) % interval == 0):  # host update
                if overlap:
                    apply()
                assert cpu_copy is not None or not overlap
                for j, (p, lr, wd) in enumerate(trained):
                    base = cpu_copy[j] if overlap else p.data  # type: ignore[index]
                    new_p, m[j], v[j] = adamw(base, acc[j] / n, m[j], v[j], t + 1, lr, wd)
                    if overlap:
                        cpu_copy[j] = new_p  # type: ignore[index]
                    else:
                        p.data = torch.where(masks[j], p.data, new_p)
                    acc[j].zero_()
                n = 0
                if overlap:
                    pending = True
                else:
                    updates += 1
    return {"losses": losses, "state": {k: t.detach().clone() for k, t in model.state_dict().items()},
            "host_updates": updates}
