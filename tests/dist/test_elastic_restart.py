"""Elastic restart, the pieces (what torchrun's elastic agent does is restart the script at a new world
size; the script resumes from the latest checkpoint): a 4-rank run checkpoints each step; losing 2 ranks,
the job resumes at 2 ranks from that checkpoint (universal load reshards ZeRO-2 states; ``train_batch_size``
stays 8 and accumulation goes from 1 to 2) and its losses equal the uninterrupted 4-rank run's within
rtol 1e-5; growing back to 4 ranks from the 2-rank run's checkpoint equals the 2-rank run continuing.

The launcher half (``--elastic_training``: two node launchers, one killed, torchrun restarts the other at
2 ranks, a new node joins back) is ``test_elastic_launch_shrinks_and_grows`` in test_multinode.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from zerospeed.testing import run_distributed

SCRIPTS = str(Path(__file__).parent / "scripts")


def _train(*args, **kwargs) -> list[float]:
    from mn_train import train  # noqa: PLC0415 - the launched script's own loop

    return train(*args, **kwargs)


def test_shrink_to_two_and_grow_back_to_four_keeps_the_loss_curve(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    sys.path.insert(0, SCRIPTS)
    try:
        four = run_distributed(_train, 4, str(tmp_path / "a"), 4, ckpt, timeout=120)[0]
        two = run_distributed(_train, 2, str(tmp_path / "b"), 5, ckpt, load_tag="step2", timeout=120)[0]
        back = run_distributed(_train, 4, str(tmp_path / "c"), 5, ckpt, load_tag="step4", save=False,
                               timeout=120)[0]
    finally:
        sys.path.remove(SCRIPTS)
    assert len(four) == 4 and len(two) == 3 and len(back) == 1
    torch.testing.assert_close(torch.tensor(two[:2]), torch.tensor(four[2:]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(back), torch.tensor(two[2:]), rtol=1e-5, atol=0)
    assert four[0] != four[2]  # the model trains: the comparison is not between constants
