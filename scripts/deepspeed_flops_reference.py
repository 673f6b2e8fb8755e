"""Write DeepSpeed's flops-profiler figures for the models of ``tests/unit/flops_models.py``.

Run with a Python that has DeepSpeed (0.19.8 was used) and this checkout's ``src`` and ``tests`` importable::

    DS_ACCELERATOR=cpu PYTHONPATH=src:. python scripts/deepspeed_flops_reference.py \
        > tests/unit/fixtures/deepspeed_flops.json

Each case runs in a fresh interpreter: DeepSpeed's ``stop_profile`` leaves ``Tensor.__matmul__`` wrapped,
so a second profile in one process would count ``@`` twice.
"""

from __future__ import annotations

import json
import subprocess
import sys


def profile_one(name: str) -> dict[str, list[int]]:
    import torch
    from deepspeed.profiling.flops_profiler.profiler import FlopsProfiler, get_module_flops, get_module_macs

    from tests.unit.flops_models import build

    model, args = build(name)
    prof = FlopsProfiler(model)
    prof.start_profile()
    with torch.no_grad():
        model(*args)
    out = {
        module_name or "<root>": [int(get_module_flops(m)), int(get_module_macs(m)),
                                  int(m.__params__ + m.__expert_params__)]
        for module_name, m in model.named_modules()
    }
    prof.end_profile()
    return out


def main() -> None:
    if len(sys.argv) == 2:
        json.dump(profile_one(sys.argv[1]), sys.stdout)
        return
    from tests.unit.flops_models import CASES

    result = {}
    for name in CASES:
        text = subprocess.run([sys.executable, __file__, name], check=True, capture_output=True, text=True).stdout
        result[name] = json.loads(text)
    json.dump({"deepspeed": "0.19.8", "torch": __import__("torch").__version__, "cases": result},
              sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
