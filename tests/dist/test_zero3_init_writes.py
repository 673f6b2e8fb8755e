"""zero.Init: a parent re-initialising its already-cut children gets exactly the weights it would get
without Init (normal_, zeros_, trunc_normal_, in-place math, ``p.data = t``); a view kept past the call
is a clear error."""

import pytest
import torch
from torch import nn

from zerospeed.testing import run_distributed

CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class Parent(nn.Module):
    def __init__(self, slice_write: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)
        self.emb = nn.Embedding(50, 16)
        self.apply(self._init)  # the children are attached (and, under Init, cut) by now
        nn.init.trunc_normal_(self.b.weight, std=0.02)
        self.b.bias.data = torch.arange(16.0)
        with torch.no_grad():
            self.a.weight.mul_(0.5)
        assert self.a.weight.shape == (32, 16)  # reads see the full value too
        if slice_write:
            self.emb.weight.data[0].zero_()
        self.scale = nn.Parameter(torch.ones(16))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            m.weight.data.normal_(0.0, 0.1)


def _build_under_init() -> dict[str, torch.Tensor]:
    from zerospeed import zero

    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=CONFIG):
        model = Parent()
    assert all(p.numel() == 0 for p in model.parameters()), "every parameter is cut"
    with zero.GatheredParameters(model):
        return {k: v.detach().clone() for k, v in model.named_parameters()}


def _slice_write() -> str:
    from zerospeed import zero

    torch.manual_seed(0)
    try:
        with zero.Init(config_dict_or_path=CONFIG):
            Parent(slice_write=True)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_reinitialising_cut_children_matches_a_plain_build() -> None:
    torch.manual_seed(0)
    expected = {k: v.detach() for k, v in Parent().named_parameters()}
    for got in run_distributed(_build_under_init, 2):
        assert got.keys() == expected.keys()
        for k in expected:
            assert torch.equal(got[k], expected[k]), k


def test_a_view_of_a_cut_parameter_is_a_clear_error() -> None:
    for msg in run_distributed(_slice_write, 2):
        assert "GatheredParameters" in msg and "view of a partitioned parameter" in msg, msg


@pytest.mark.parametrize("world", [2, 4])
def test_demo_gpt_under_init_equals_plain_build(world: int) -> None:
    from zerospeed.models import GPT, tiny

    expected = {k: v.detach() for k, v in GPT(tiny(), seed=3).named_parameters()}
    for got in run_distributed(_gpt_under_init, world):
        for k in expected:
            assert torch.equal(got[k], expected[k]), k


def _gpt_under_init() -> dict[str, torch.Tensor]:
    from zerospeed import zero
    from zerospeed.models import GPT, tiny

    with zero.Init(config_dict_or_path=CONFIG):
        model = GPT(tiny(), seed=3)
    with zero.GatheredParameters(model):
        return {k: v.detach().clone() for k, v in model.named_parameters()}
