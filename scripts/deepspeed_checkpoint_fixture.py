"""Write the DeepSpeed checkpoints that tests/dist/test_convert_deepspeed.py converts (run by hand, with DeepSpeed).

    PYTHONPATH=src DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python scripts/deepspeed_checkpoint_fixture.py

DeepSpeed 0.19.8 trains a micro GPT (tied embeddings, ~2.9k parameters) on 2 CPU ranks (Gloo, fp32, AdamW,
WarmupLR) for 3 steps at ZeRO stages 1, 2 and 3, saves a checkpoint, then trains 3 more steps and records each
rank's losses. The checkpoints (small enough to ship) and the continuation losses go to
``tests/fixtures/deepspeed/``; zerospeed must continue that loss curve after converting the checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "deepspeed"
sys.path.insert(0, str(ROOT / "tests" / "dist"))

from ds_ckpt_common import MICRO, batches, config, micro_gpt  # noqa: E402

from zerospeed.testing import run_distributed  # noqa: E402


def _run(stage: int, path: str) -> dict:
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    model = micro_gpt()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    rank = torch.distributed.get_rank()
    losses = []
    for step in range(6):
        if step == 3:
            engine.save_checkpoint(path, tag="step3")
        x, y = batches(step)[rank]
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return {"before": losses[:3], "after": losses[3:], "version": deepspeed.__version__}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    record = {}
    for stage in (1, 2, 3):
        path = OUT / f"stage{stage}"
        shutil.rmtree(path, ignore_errors=True)
        r0, r1 = run_distributed(_run, 2, stage, str(path), timeout=600)
        record[f"stage{stage}"] = {"losses": [r0["after"], r1["after"]], "before": [r0["before"], r1["before"]],
                                   "deepspeed": r0["version"], "micro_batch": MICRO}
        for f in path.rglob("zero_to_*.py"):
            f.unlink()  # DeepSpeed's scripts: not ours to ship
    (OUT / "losses.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    print({str(p.relative_to(OUT)): p.stat().st_size for p in OUT.rglob("*") if p.is_file()})


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
