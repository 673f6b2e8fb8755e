"""DeepSpeed's losses for the precision variants, to pin in tests/dist/test_precision_variants.py.

Runs the parity fixture (tests/dist/parity.py: TinyNet, its two parameter groups, its batches) through the real
DeepSpeed on one process (CPU, Gloo) and prints one JSON line per case: the
losses and the final L2 norm of every parameter (in fp32; more sensitive than bf16 losses). Needs a venv with deepspeed==0.19.8:

    cd <repo> && PYTHONPATH=$PWD DS_ACCELERATOR=cpu /work/venv-ds/bin/python benchmarks/ds_precision_losses.py

``--world 2`` runs them on two ranks instead (forked processes, Gloo; the same global batch: micro-batch 2 x 1
accumulation step x 2 ranks), where the gradients are really reduced (``torch_autocast``: the lower-precision-safe
modules' gradients in bf16):

    cd <repo> && PYTHONPATH=$PWD DS_ACCELERATOR=cpu /work/venv-ds/bin/python benchmarks/ds_precision_losses.py \
        --world 2 autocast_bf16_stage1 autocast_bf16_stage2 autocast_bf16_stage0

The ZeRO-Offload cases (named on the command line) need DeepSpeedCPUAdam's kernel: its JIT build, or a linked
``cpu_adam.so`` named by ``DS_CPU_ADAM_SO`` (2026-12-02: its objects from DeepSpeed's build directory,
``~/.cache/torch_extensions/py311_cpu/cpu_adam``, linked by hand with the link line of its ``build.ninja``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

CASES: dict[str, dict[str, Any]] = {
    "autocast_bf16_stage1": {"zero_optimization": {"stage": 1},
                             "torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
    "autocast_bf16_stage2": {"zero_optimization": {"stage": 2},
                             "torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
    "autocast_bf16_stage0": {"zero_optimization": {"stage": 0},
                             "torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
    "bf16_stage2": {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}},
    "bf16_master_states_stage2": {"zero_optimization": {"stage": 2}, "bf16": {
        "enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
    "bf16_master_states_stage1": {"zero_optimization": {"stage": 1}, "bf16": {
        "enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
    # BF16_Optimizer (bf16 at stage 1 with fp32 gradient accumulation), its gradients moved as they arrive or not
    "bf16_accum_fp32_immediate_stage1": {"zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"},
                                         "bf16": {"enabled": True, "immediate_grad_update": True}},
    "bf16_accum_fp32_stage1": {"zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"},
                               "bf16": {"enabled": True}},
    "bf16_accum_bf16_stage1": {"zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "bf16"},
                               "bf16": {"enabled": True}},
    # ZeRO-Offload: DeepSpeedCPUAdam (its JIT build takes minutes the first time)
    "bf16_master_offload_stage2": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                                   "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
    "bf16_master_states_offload_stage2": {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
    "bf16_offload_stage2": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                            "bf16": {"enabled": True}},
}
OFFLOADED = {name for name, case in CASES.items() if "offload_optimizer" in case["zero_optimization"]}
STEPS, MB, GAS, CLIP, LR = 6, 2, 2, 0.5, 1e-2


def run(case: dict[str, Any], offloaded: bool, rank: int = 0, world: int = 1) -> tuple[list[float], dict[str, float]]:
    import deepspeed

    from tests.dist.parity import make_model, micro_batch, param_groups

    model = make_model()
    gas = GAS // world
    config = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                         **({} if offloaded else {"torch_adam": True})}},
              "steps_per_print": 1000, **case}
    dtype = torch.bfloat16 if case.get("bf16", {}).get("enabled") else torch.float32
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for m in range(gas):
            x, y = micro_batch(step, m, rank, world, MB, gas)
            loss = engine(x.to(dtype), y.to(dtype))
            engine.backward(loss)
            engine.step()
            total += float(loss) / gas
        mean = torch.tensor([total], dtype=torch.float64)
        if world > 1:
            deepspeed.comm.all_reduce(mean)
        losses.append(float(mean) / world)
    norms = {n: float(p.detach().float().norm()) for n, p in model.named_parameters()}
    engine.destroy()
    return losses, norms


def _prebuilt_cpu_adam(path: str) -> None:
    """Load DeepSpeedCPUAdam's kernel from an already linked ``cpu_adam.so`` (``DS_CPU_ADAM_SO``) instead of its
    JIT build (minutes, and it waits forever on a build lock another process left behind)."""
    import importlib.machinery
    import importlib.util

    import deepspeed.ops.adam.cpu_adam as cpu_adam

    loader = importlib.machinery.ExtensionFileLoader("cpu_adam", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("cpu_adam", loader))
    loader.exec_module(module)
    cpu_adam.CPUAdamBuilder.load = lambda self, verbose=True: module


def main() -> None:
    import deepspeed.ops

    if os.environ.get("DS_CPU_ADAM_SO"):
        _prebuilt_cpu_adam(os.environ["DS_CPU_ADAM_SO"])

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no 3-minute JIT build
    args = sys.argv[1:]
    world = 1
    if args[:1] == ["--world"]:
        world, args = int(args[1]), args[2:]
    names = args or [n for n in CASES if n not in OFFLOADED]
    if world == 1:
        _rank(0, 1, names)
        return
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(world, names), nprocs=world, start_method="fork")


def _rank(rank: int, world: int, names: list[str]) -> None:
    import deepspeed

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29533")})
    for name in names:
        losses, norms = run(CASES[name], name in OFFLOADED, rank, world)
        if rank == 0:
            print(json.dumps({"case": name, "deepspeed": deepspeed.__version__, "world": world, "losses": losses,
                              "norms": norms}), flush=True)


if __name__ == "__main__":
    import deepspeed

    main()
