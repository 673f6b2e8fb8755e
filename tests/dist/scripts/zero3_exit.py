"""A small stage-3 run whose exit is checked: prints whether the process group was still alive at exit.

Registered before anything else, the report runs last among the exit handlers (last in, first out),
i.e. after zerospeed's own.
"""

import atexit


def _report() -> None:
    import torch.distributed as dist

    print(f"process group alive at exit: {dist.is_initialized()}", flush=True)


atexit.register(_report)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import zerospeed  # noqa: E402

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                "stage3_prefetch_bucket_size": 600, "stage3_max_reuse_distance": 0}}
engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
for _ in range(3):
    engine.backward(engine(torch.randn(2, 16)).pow(2).mean())
    engine.step()
