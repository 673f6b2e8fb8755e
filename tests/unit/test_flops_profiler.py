"""Flops profiler: exact hand-computed counts, per-module attribution, report, MFU and engine hooks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerospeed import checkpointing as ck
from zerospeed.config.monitoring import FlopsProfilerConfig
from zerospeed.profiling.flops_profiler import FlopsProfiler, get_model_profile, mfu, peak_flops
from zerospeed.profiling.timers import Timers


def counts(model: nn.Module, *args, **kwargs) -> tuple[int, int, int]:
    return get_model_profile(model, args=args, kwargs=kwargs, print_profile=False, as_string=False, warm_up=0)


def test_linear_counts_two_flops_per_mac_and_ignores_bias() -> None:
    b, n_in, n_out = 3, 8, 5
    flops, macs, params = counts(nn.Linear(n_in, n_out), torch.randn(b, n_in))
    assert macs == b * n_in * n_out
    assert flops == 2 * macs
    assert params == n_in * n_out + n_out
    flops, macs, _ = counts(nn.Linear(n_in, n_out, bias=False), torch.randn(2, 7, n_in))
    assert (flops, macs) == (2 * 2 * 7 * n_in * n_out, 2 * 7 * n_in * n_out)


def test_input_shape_and_string_results_follow_deepspeed() -> None:
    flops, macs, params = get_model_profile(nn.Linear(8, 5), input_shape=(3, 8), print_profile=False)
    assert (flops, macs, params) == ("240 ", "120 MACs", "45")
    flops, macs, params = get_model_profile(nn.Linear(100, 200), input_shape=(50, 100), print_profile=False)
    assert (flops, macs, params) == ("2 M", "1 MMACs", "20.2 K")


def test_conv_counts_include_bias_adds() -> None:
    n, c_in, c_out, k, hw = 2, 3, 4, 3, 8
    flops, macs, _ = counts(nn.Conv2d(c_in, c_out, k, padding=1), torch.randn(n, c_in, hw, hw))
    expected_macs = n * hw * hw * c_out * c_in * k * k
    assert macs == expected_macs
    assert flops == 2 * expected_macs + n * c_out * hw * hw
    # grouped, no bias
    flops, macs, _ = counts(nn.Conv2d(4, 6, 3, groups=2, bias=False), torch.randn(1, 4, 5, 5))
    assert macs == 1 * 3 * 3 * 6 * (4 // 2) * 9 and flops == 2 * macs
    # transposed: every input position meets every weight element; bias once per output element
    flops, macs, _ = counts(nn.ConvTranspose2d(4, 2, 3, stride=2), torch.randn(1, 4, 5, 5))
    assert macs == 25 * 4 * 2 * 9
    assert flops == 2 * macs + 2 * 11 * 11


class MatMuls(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bmm(torch.matmul(a, b).flatten(0, 1), b.flatten(0, 1).transpose(1, 2)) @ torch.ones(5, 2)


def test_matmul_and_bmm() -> None:
    a, b = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 5, 6)
    flops, macs, _ = counts(MatMuls(), a, b)
    expected = 2 * 3 * 4 * 5 * 6 + 6 * 4 * 6 * 5 + 6 * 4 * 5 * 2
    assert macs == expected and flops == 2 * expected


class Attention(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = p

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_attention_counts_the_two_products_whatever_the_backend(dropout: float) -> None:
    bs, h, L, S, e, ev = 2, 3, 4, 6, 8, 10
    q, k, v = torch.randn(bs, h, L, e), torch.randn(bs, h, S, e), torch.randn(bs, h, S, ev)
    model = Attention(dropout).train()  # dropout > 0 takes the math (bmm + softmax) path on CPU
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(q, k, v)
    prof.stop_profile()
    expected = bs * h * L * S * (e + ev)
    assert prof.get_total_macs() == expected
    assert prof.get_total_flops() == 2 * expected


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.mlp(h)
        return self.head(self.norm(h))


def test_embedding_model_per_module_attribution() -> None:
    b, t, v, d = 2, 7, 50, 16
    model = TinyLM(v, d)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randint(0, v, (b, t)))
    prof.stop_profile()
    tokens = b * t
    fc_macs = tokens * d * 4 * d
    assert prof.module_stats(model.embed).flops == 0
    assert prof.module_stats(model.mlp[0]).macs == fc_macs
    assert prof.module_stats(model.mlp[1]).flops == tokens * 4 * d  # ReLU: one per element
    assert prof.module_stats(model.mlp).macs == 2 * fc_macs
    assert prof.module_stats(model.norm).flops == 5 * tokens * d  # affine layer norm
    assert prof.module_stats(model.head).macs == tokens * d * v
    total_macs = 2 * fc_macs + tokens * d * v
    assert prof.get_total_macs() == total_macs
    # the residual ``h + ...`` is operator syntax: DeepSpeed does not count it, nor do we
    assert prof.get_total_flops() == 2 * total_macs + tokens * 4 * d + 5 * tokens * d
    assert prof.get_total_params() == sum(p.numel() for p in model.parameters())
    assert prof.module_stats(model.mlp).calls == 1
    assert prof.get_total_duration() >= prof.module_stats(model.mlp).duration > 0


def test_only_forward_between_start_and_stop_is_counted() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    prof = FlopsProfiler(model)
    prof.start_profile()
    loss = model(x).sum()
    loss.backward()  # backward is never counted
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1 * p.grad)  # an optimizer-like update is not counted either
    forward_flops = prof.get_total_flops()
    assert forward_flops == 2 * (4 * 8 * 8 + 4 * 8 * 2)
    prof.stop_profile()
    model(x)  # after stop: not counted, numbers kept
    assert prof.get_total_flops() == forward_flops
    prof.end_profile()
    assert prof.get_total_flops() == 0 and not prof.started


def test_checkpoint_recompute_is_not_counted_and_step_flops_use_factor() -> None:
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = block

        def forward(self, x):
            return ck.checkpoint(self.block, x)

    model = Model()
    prof = FlopsProfiler(model, config=FlopsProfilerConfig(recompute_fwd_factor=1.0))
    prof.start_profile()
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    fwd = 2 * 2 * 4 * 8 * 8 + 4 * 8
    assert prof.get_total_flops() == fwd
    assert prof.step_flops() == 4 * fwd
    prof.end_profile()


def test_ignore_modules_keep_totals_as_deepspeed() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    flops, macs, _ = get_model_profile(
        model, input_shape=(2, 8), print_profile=False, as_string=False, ignore_modules=[nn.ReLU]
    )
    assert macs == 2 * 8 * 8 + 2 * 8 * 4 and flops == 2 * macs + 2 * 8  # the ReLU counts for its parent


def test_report_file_has_summary_tree_and_mfu_na_on_cpu(tmp_path) -> None:
    out = tmp_path / "sub" / "profile.txt"
    get_model_profile(TinyLM(), args=[torch.randint(0, 50, (2, 3))], output_file=str(out), top_modules=2)
    text = out.read_text()
    for needle in ["Profile Summary at step 1", "fwd MACs per GPU", "MFU", "n/a", "depth 1:",
                   "(mlp): Sequential(", "(head): Linear(", "% MACs"]:
        assert needle in text, needle


def test_peak_table_and_mfu() -> None:
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("cpu") is None
    assert mfu(494.5e12, "NVIDIA H200") == pytest.approx(0.5)
    assert mfu(1e12, "cpu") is None


class FakeEngine:
    """What an engine exposes to the profiler."""

    world_size = 2
    dp_world_size = 2
    mp_world_size = 1

    def __init__(self) -> None:
        self.timers = Timers(synchronize=lambda: None)
        for name in ("forward", "backward", "step"):
            self.timers(name).start()
            self.timers(name).stop()

    def train_micro_batch_size_per_gpu(self) -> int:
        return 4

    def wall_clock_breakdown(self) -> bool:
        return True


def test_engine_hooks_profile_only_the_configured_step(capsys) -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    config = FlopsProfilerConfig(enabled=True, profile_step=2, detailed=False, recompute_fwd_factor=1.0)
    prof = FlopsProfiler(model, FakeEngine(), config=config)
    for step in range(1, 4):
        prof.on_forward_start(step)
        model(torch.randn(4, 8)).sum().backward()
        prof.on_forward_end()
        prof.on_step_end(step)
    printed = capsys.readouterr().out
    assert printed.count("Profile Summary at step 2") == 1
    for needle in ["world size:", "batch size per GPU:", "bwd latency", "= 4 * fwd flops per GPU / iter latency",
                   "samples/second", "MFU"]:
        assert needle in printed, needle
    assert "Detailed Profile" not in printed
    assert not prof.started


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="nn.Module"):
        get_model_profile(lambda x: x, input_shape=(1,))
    with pytest.raises(ValueError, match="input_shape"):
        get_model_profile(nn.Linear(2, 2), input_shape=[1, 2])
    with pytest.raises(ValueError, match="args or kwargs"):
        get_model_profile(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="recompute_fwd_factor"):
        FlopsProfiler(nn.Linear(2, 2), recompute_fwd_factor=-1)


def test_get_model_profile_restores_training_mode() -> None:
    import torch
    from torch import nn

    from zerospeed.profiling.flops_profiler import get_model_profile

    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    model.train()
    get_model_profile(model, input_shape=(2, 4), print_profile=False)
    assert model.training and model[1].training
    model.eval()
    get_model_profile(model, args=[torch.zeros(2, 4)], print_profile=False)
    assert not model.training
