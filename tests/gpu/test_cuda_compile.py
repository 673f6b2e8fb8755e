"""engine.compile() on CUDA/NCCL with inductor (Triton): compiled training equals eager at stages 0 and 3."""

import pytest
import torch

from zerospeed.testing import run_distributed

from ..dist.test_compile import _train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _eager_and_inductor(stage: int) -> tuple[list[float], list[float]]:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    return _train(zero, None)[0], _train(zero, "inductor")[0]


@pytest.mark.parametrize("stage", [0, 3])
def test_inductor_compiled_training_matches_eager_cuda(stage: int) -> None:
    world = 2 if torch.cuda.device_count() >= 2 else 1
    for eager, compiled in run_distributed(_eager_and_inductor, world, stage, backend="nccl", timeout=600):
        # TF32 and fused reductions on the device: a looser tolerance than CPU's.
        torch.testing.assert_close(compiled, eager, rtol=2e-3, atol=1e-4)
