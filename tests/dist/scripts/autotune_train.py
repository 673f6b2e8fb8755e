"""Launched by tests/dist/test_autotuning.py through `zerospeed autotune`: a small model trained until the engine
(profiling an autotuning experiment) ends the run."""

import argparse

import torch

import zerospeed

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config", required=True)
parser.add_argument("--local_rank", type=int, default=-1)  # zerospeed launch passes it (as DeepSpeed's)
args = parser.parse_args()
zerospeed.init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
engine, *_ = zerospeed.initialize(args=args, model=model, model_parameters=model.parameters())
micro = engine.train_micro_batch_size_per_gpu()
for _ in range(100 * engine.gradient_accumulation_steps()):
    loss = engine(torch.randn(micro, 32)).pow(2).mean()
    engine.backward(loss)
    engine.step()
raise SystemExit("the autotuning probe did not end the run")
