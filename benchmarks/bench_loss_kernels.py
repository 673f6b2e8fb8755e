"""Is zerospeed's last-loss gap to DDP the Adam kernel or the reduction order? (issue 38)

    PYTHONPATH=src .venv/bin/python benchmarks/bench_loss_kernels.py [preset]

One paired round (micro-batch 8, 1 warm-up + 4 steps, world 2): DDP with torch's AdamW and with its fused kernel,
FSDP2, zerospeed stages 0-1 with the default (fused) kernel and with ``torch_adam: true``, stage 3 with torch_adam;
the last losses to 7 decimals and CPU time ÷ DDP."""

from __future__ import annotations

import sys
from typing import Any

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from contenders import BenchSpec, ddp, fsdp2, zerospeed_stage  # noqa: E402
from harness import run_all  # noqa: E402


def _adamw(spec: BenchSpec, torch_adam: bool) -> dict[str, Any]:
    return {"optimizer": {"type": "AdamW", "params": {"lr": spec.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": spec.weight_decay, "torch_adam": torch_adam}}}


def main() -> int:
    spec = BenchSpec(preset=sys.argv[1] if len(sys.argv) > 1 else "7m", micro_batch=8, grad_accum=1, world_size=2,
                     warmup=1, steps=4)
    cs = [ddp(), ddp(fused=True), fsdp2(),
          zerospeed_stage(0), zerospeed_stage(0, name="zerospeed stage 0, torch_adam", extra=_adamw(spec, True)),
          zerospeed_stage(1), zerospeed_stage(1, name="zerospeed stage 1, torch_adam", extra=_adamw(spec, True)),
          zerospeed_stage(3, name="zerospeed stage 3, torch_adam", extra=_adamw(spec, True))]
    for r in run_all(spec, cs, baseline="torch DDP", repeat=1):
        print(f"{r.contender:32s} {r.last_loss:.7f}  CPU {r.cpu_ratio:.3f}x DDP")
    return 0


if __name__ == "__main__":
    sys.exit(main())
