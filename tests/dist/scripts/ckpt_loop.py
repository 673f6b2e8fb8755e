"""Launched by tests/dist/test_sigterm_checkpoint.py: train and checkpoint every step until stopped.

usage: ckpt_loop.py CKPT_DIR
"""

import sys

import torch

import zerospeed
from zerospeed import comm

zerospeed.init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
engine, *_ = zerospeed.initialize(model=model, config={
    "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2}})
step = 0
while True:
    loss = engine(torch.randn(4, 64)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    step += 1
    engine.save_checkpoint(sys.argv[-1], tag=f"step{step}")  # after the launcher's --local_rank
    if comm.get_rank() == 0:
        print(f"saved step{step}", flush=True)
