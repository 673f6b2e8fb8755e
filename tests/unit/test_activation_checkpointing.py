"""Activation checkpointing: bitwise parity with dropout, options, config errors, activation-memory saving."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerospeed import checkpointing as ck
from zerospeed.config.errors import ConfigError
from zerospeed.config.monitoring import ActivationCheckpointingConfig
from zerospeed.profiling.timers import Timers

B, T, D = 2, 5, 16


@pytest.fixture(autouse=True)
def _fresh_state():
    ck.reset()
    yield
    ck.reset()


class Block(nn.Module):
    """A small pre-norm transformer block with dropout everywhere (attention + MLP)."""

    def __init__(self, dim: int = D, heads: int = 2, p: float = 0.2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(p)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm2(x)))))


def make_stack(n: int = 3) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList([Block() for _ in range(n)])


def run(blocks: nn.ModuleList, x: torch.Tensor, use_ckpt: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(123)
    blocks.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    h = x
    for block in blocks:
        h = ck.checkpoint(block, h) if use_ckpt else block(h)
    loss = F.dropout(h, 0.1).pow(2).mean()  # draws RNG after the checkpointed regions too
    loss.backward()
    grads = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
    return loss.detach(), grads


def assert_bitwise(a, b) -> None:
    assert torch.equal(a[0], b[0]), (a[0].item(), b[0].item())
    assert len(a[1]) == len(b[1])
    for ga, gb in zip(a[1], b[1]):
        assert torch.equal(ga, gb)


def test_dropout_losses_and_grads_bitwise_equal() -> None:
    blocks = make_stack()
    x = torch.randn(B, T, D)
    reference = run(blocks, x, use_ckpt=False)
    assert_bitwise(reference, run(blocks, x, use_ckpt=True))
    # dropout really is on: the same block draws a different output under another seed
    with torch.no_grad():
        torch.manual_seed(1)
        first = blocks[0](x)
        torch.manual_seed(2)
        assert not torch.equal(first, blocks[0](x))


def test_cpu_checkpointing_runs_the_host_path_and_stays_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = ck._to_host

    def spy(t: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(t.shape))
        return real(t)

    monkeypatch.setattr(ck, "_to_host", spy)
    ck.configure(ActivationCheckpointingConfig(cpu_checkpointing=True))
    blocks = make_stack()
    x = torch.randn(B, T, D)
    assert_bitwise(run(blocks, x, use_ckpt=False), run(blocks, x, use_ckpt=True))
    assert calls == [(B, T, D)] * 3


def test_rng_tracker_stream_is_replayed_in_recompute() -> None:
    ck.model_parallel_cuda_manual_seed(42)
    tracker = ck.get_cuda_rng_tracker()
    lin = nn.Linear(8, 8)
    x0 = torch.randn(4, 8)

    def region(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            x = F.dropout(lin(x), 0.5)
        return F.dropout(x, 0.5)

    results = []
    for use in (False, True):
        ck.model_parallel_cuda_manual_seed(42)
        lin.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        out = ck.checkpoint(region, x) if use else region(x)
        out.sum().backward()
        results.append((out.detach(), [lin.weight.grad.clone(), x.grad.clone()]))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def test_kwargs_multiple_outputs_and_non_tensor_args() -> None:
    lin = nn.Linear(4, 4)

    def region(x: torch.Tensor, scale: float, *, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.tanh(lin(x)) * scale
        return y + shift, y.exp()

    x = torch.randn(3, 4, requires_grad=True)
    shift = torch.randn(4, requires_grad=True)
    a, b = region(x, 2.0, shift=shift)
    (a.sum() + b.sum()).backward()
    ref = [x.grad.clone(), shift.grad.clone(), lin.weight.grad.clone()]
    x.grad = shift.grad = lin.weight.grad = None
    a, b = ck.checkpoint(region, x, 2.0, shift=shift)
    (a.sum() + b.sum()).backward()
    for r, g in zip(ref, [x.grad, shift.grad, lin.weight.grad]):
        assert torch.equal(r, g)


def test_retain_graph_second_backward_recomputes_again() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    out = ck.checkpoint(lambda t: torch.sigmoid(lin(t)), x).sum()
    out.backward(retain_graph=True)
    first = lin.weight.grad.clone()
    out.backward()
    assert torch.allclose(lin.weight.grad, 2 * first)


def test_no_grad_just_runs() -> None:
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        out = ck.checkpoint(lin, torch.randn(2, 4))
    assert out.grad_fn is None
    assert ck.checkpointed_bytes() == 0


def test_autocast_state_is_replayed() -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True)
    grads = []
    for use in (False, True):
        lin.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ck.checkpoint(lambda t: lin(t).relu(), x) if use else lin(x).relu()
        out.float().sum().backward()
        grads.append(lin.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_nondeterministic_region_is_reported() -> None:
    lin = nn.Linear(4, 4)
    calls = {"n": 0}

    def region(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        y = lin(x)
        return y.exp() if calls["n"] == 1 else y * 2
    out = ck.checkpoint(region, torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="same operations"):
        out.sum().backward()


def saved_activation_bytes(blocks: nn.ModuleList, x: torch.Tensor, use_ckpt: bool) -> int:
    """Bytes of non-parameter tensors kept for backward after the forward (deterministic, no timing)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in blocks.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = x
        for block in blocks:
            h = ck.checkpoint(block, h) if use_ckpt else block(h)
        loss = h.sum()
    total = sum(storages.values()) + ck.checkpointed_bytes()
    loss.backward()
    return total


def test_checkpointing_reduces_saved_activation_memory() -> None:
    blocks = make_stack(4)
    x = torch.randn(B, T, D, requires_grad=True)
    plain = saved_activation_bytes(blocks, x, use_ckpt=False)
    ckpt = saved_activation_bytes(blocks, x, use_ckpt=True)
    # with checkpointing only each block's input (B*T*D fp32) is held
    assert ckpt == 4 * B * T * D * 4
    assert plain > 10 * ckpt
    assert ck.checkpointed_bytes() == 0  # released once backward has run


def test_partition_activations_mp1_is_noop_and_larger_group_refuses() -> None:
    ck.configure(ActivationCheckpointingConfig(partition_activations=True))
    blocks = make_stack(1)
    x = torch.randn(B, T, D)
    assert_bitwise(run(blocks, x, use_ckpt=False), run(blocks, x, use_ckpt=True))

    class Mpu:
        def get_model_parallel_world_size(self) -> int:
            return 2

    with pytest.raises(NotImplementedError, match="activation_checkpointing.partition_activations"):
        ck.configure(Mpu(), partition_activations=True)
    with pytest.raises(NotImplementedError, match="partition_activations"):
        ck.configure(ActivationCheckpointingConfig(partition_activations=True), mp_world_size=4)
    ck.configure(Mpu())  # without partitioning a model-parallel mpu is fine


def test_contiguous_needs_partition_and_number_checkpoints() -> None:
    with pytest.raises(ConfigError, match="contiguous_memory_optimization"):
        ck.configure(contiguous_checkpointing=True)
    with pytest.raises(ConfigError, match="number_checkpoints"):
        ck.configure(partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(ConfigError, match="number_checkpoints"):
        ck.configure(num_checkpoints=0)
    config = ck.configure(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    assert config.contiguous_memory_optimization
    blocks = make_stack(2)
    x = torch.randn(B, T, D)
    assert_bitwise(run(blocks, x, use_ckpt=False), run(blocks, x, use_ckpt=True))


def test_configure_from_deepspeed_config(tmp_path) -> None:
    assert not ck.is_configured()
    section = {"cpu_checkpointing": True, "number_checkpoints": 4, "profile": True}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": section}))
    config = ck.configure(None, deepspeed_config=str(path), synchronize=True)
    assert ck.is_configured()
    assert config.cpu_checkpointing and config.number_checkpoints == 4 and config.profile
    assert config.synchronize_checkpoint_boundary
    with pytest.raises(ConfigError, match="activation_checkpointing.cpu_checkpoint"):
        ck.configure(deepspeed_config={"activation_checkpointing": {"cpu_checkpoint": True}})
    ck.reset()
    assert not ck.is_configured()


def test_synchronize_and_profile_at_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    syncs = []
    monkeypatch.setattr(ck, "_device_synchronize", lambda: syncs.append(1))
    timers = Timers(synchronize=lambda: None)
    ck.configure(ActivationCheckpointingConfig(synchronize_checkpoint_boundary=True, profile=True), timers=timers)
    blocks = make_stack(3)
    run(blocks, torch.randn(B, T, D), use_ckpt=True)
    assert len(syncs) == 2 * (3 + 3)  # start and end of 3 forwards and 3 recomputes
    assert timers(ck.FORWARD_TIMER).count == 3
    assert timers(ck.RECOMPUTE_TIMER).count == 3
    assert timers(ck.RECOMPUTE_TIMER).elapsed() >= 0.0


def test_rng_tracker_errors() -> None:
    tracker = ck.RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="already tracked"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="already tracked"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="not tracked"):
        with tracker.fork("missing"):
            pass
