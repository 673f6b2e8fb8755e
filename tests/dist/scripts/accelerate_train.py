"""Launched by tests/dist/test_accelerate.py through `accelerate launch`: a zerospeed training script whose
config was converted from an Accelerate DeepSpeed config. Writes one JSON file per rank beside the config."""

import json
import os
import sys

import torch

import zerospeed
from zerospeed import comm

zerospeed.init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # Accelerate configs leave the optimizer to the script
engine, *_ = zerospeed.initialize(model=model, optimizer=optimizer, config=sys.argv[1])
g = torch.Generator().manual_seed(comm.get_rank())
losses = []
for _ in range(3):
    for _ in range(engine.gradient_accumulation_steps()):
        loss = engine(torch.randn(2, 8, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    losses.append(float(loss))
result = {"rank": comm.get_rank(), "world": comm.get_world_size(), "local_rank": engine.local_rank,
          "stage": engine.zero_optimization_stage(), "gas": engine.gradient_accumulation_steps(), "losses": losses}
with open(os.path.join(os.path.dirname(sys.argv[1]), f"result_{comm.get_rank()}.json"), "w") as f:
    json.dump(result, f)  # a file per rank: the ranks' stdout lines may interleave
comm.barrier()
comm.destroy()
