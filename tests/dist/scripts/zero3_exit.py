"""A small stage-3 run that ends right after collectives, while its engine still refers to the group.

Its last lines are many small all-gathers, so that a Gloo worker thread is likely still finishing one
when the interpreter starts to exit: the case that aborted with ``terminate called without an active
exception`` before zerospeed let the workers settle at exit.
"""

import torch
from torch import nn

import zerospeed
from zerospeed import comm

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                "stage3_prefetch_bucket_size": 600, "stage3_max_reuse_distance": 0}}
engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
for _ in range(3):
    engine.backward(engine(torch.randn(2, 16)).pow(2).mean())
    engine.step()
out = torch.empty(1000 * comm.get_world_size())
for _ in range(200):
    comm.all_gather(out, torch.ones(1000), group=engine.zero3.dp_group)
