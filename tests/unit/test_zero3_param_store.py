"""ZeRO-3 shard states and module hooks in one process (world size 1: a shard is the whole parameter,
but every transition, hook and release path is the same as with N ranks)."""

import pytest
import torch
from torch import nn

from zerospeed.zero.stage3 import Fetcher, GatheredParameters, ShardState, Unit, shard_of
from zerospeed.zero.stage3.hooks import install
from zerospeed.zero.stage3.param_store import GatherOp, partition


def _partitioned(module: nn.Module) -> tuple[Fetcher, dict[int, Unit]]:
    shards = [partition(p, None, persistent=False) for p in module.parameters()]
    units, unit_of = [], {}
    for m in module.modules():
        mine = [shard_of(p) for p in m._parameters.values() if p is not None]
        if mine:
            unit_of[id(m)] = Unit(len(units), "", mine)
            units.append(unit_of[id(m)])
    fetcher = Fetcher(units, shards, prefetch_numel=10_000, max_live_numel=10_000)
    install(module, fetcher, unit_of)
    return fetcher, unit_of


def test_transitions_are_checked() -> None:
    p = nn.Parameter(torch.arange(6.0).view(2, 3))
    s = partition(p, None, persistent=False)
    assert s.state is ShardState.SHARDED and p.shape == (0,) and s.shape == (2, 3)
    with pytest.raises(RuntimeError, match="cannot set the gathered value while gathered"):
        GatherOp([s], async_op=False).finish()
        s.set_full(torch.zeros(6))
    assert s.state is ShardState.GATHERED and torch.equal(p, torch.arange(6.0).view(2, 3))
    s.holders.add("someone")
    s.release()
    assert s.state is ShardState.GATHERED  # still held
    s.holders.clear()
    s.release()
    assert s.state is ShardState.SHARDED and p.numel() == 0
    with pytest.raises(RuntimeError, match="partition"):
        s.cut()


def test_hooks_gather_for_forward_and_backward_then_release() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    ref = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    ref.load_state_dict(model.state_dict())
    fetcher, _ = _partitioned(model)
    x = torch.randn(3, 4)
    for _ in range(2):  # the second pass runs with prefetch in the recorded order
        out = model(x)
        assert all(p.numel() == 0 for p in model.parameters())  # released after forward
        out.sum().backward()
        fetcher.end_backward()
        fetcher.recording = False
        assert all(p.numel() == 0 for p in model.parameters())
    ref(x).sum().backward()
    with GatheredParameters(model.parameters()):
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, 2 * q.grad)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))
    assert fetcher.prefetched_numel > 0


class _SharedTwice(nn.Module):
    """``shared`` runs twice in a forward, ``mid`` (20 elements) between its two uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared, self.mid, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.shared(torch.tanh(self.mid(torch.tanh(self.shared(x)))))))


def _gathers_in_second_step(max_reuse: int, max_live: int = 10_000) -> tuple[int, int]:
    """(gathers of shared.weight in the second step's forward, in its backward)."""
    model = _SharedTwice()
    fetcher, _ = _partitioned(model)
    fetcher.max_reuse_numel, fetcher.max_live_numel, fetcher.prefetch_numel = max_reuse, max_live, 0
    weight = shard_of(model.shared.weight)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    fetcher.end_backward()  # the order is recorded
    start = weight.gathers
    out = model(x)
    forward = weight.gathers - start
    out.sum().backward()
    fetcher.end_backward()
    assert all(p.numel() == 0 for p in model.parameters())  # all released at the end of backward
    assert not fetcher.kept
    return forward, weight.gathers - start - forward


def test_reuse_distance_keeps_a_layer_used_twice_gathered() -> None:
    assert _gathers_in_second_step(0) == (2, 1)  # released after each forward use (backward: held to its end)
    assert _gathers_in_second_step(1_000_000) == (1, 0)  # kept from its first use to the end of backward
    # DeepSpeed's walk: the 20 elements of `mid` lie between the two uses of `shared`.
    assert _gathers_in_second_step(20)[0] == 2
    assert _gathers_in_second_step(21)[0] == 1
    # Nothing is kept while more than stage3_max_live_parameters elements are gathered.
    assert _gathers_in_second_step(1_000_000, max_live=10)[0] == 2


def test_gather_send_is_a_view_of_adjacent_master_slices() -> None:
    """fp32 shards aliased to the master are sent without a copy; anything else is concatenated."""
    from zerospeed.zero.stage3.param_store import _joined

    master = torch.arange(10.0)
    parts = [master[0:3], master[3:7], master[7:10]]
    send = _joined(parts)
    assert send.data_ptr() == master.data_ptr() and torch.equal(send, master)
    gap = _joined([master[0:3], master[4:7]])
    assert gap.data_ptr() != master.data_ptr() and gap.tolist() == [0.0, 1.0, 2.0, 4.0, 5.0, 6.0]
    other = _joined([master[0:3], torch.arange(3.0)])
    assert other.tolist() == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]


def test_huge_page_buffers_are_plain_tensors() -> None:
    from zerospeed.accelerator.huge_pages import MIN_BYTES, advise_huge_pages, empty_buffer, zeros_buffer

    z = zeros_buffer(MIN_BYTES // 4 + 3, torch.float32, "cpu")
    assert z.shape == (MIN_BYTES // 4 + 3,) and not z.any()
    assert empty_buffer(5, torch.float32, "cpu").shape == (5,)
    assert not advise_huge_pages(torch.empty(8))  # small: left alone
    assert not advise_huge_pages(torch.empty(MIN_BYTES))  # off unless ZEROSPEED_HUGE_PAGES=1


def test_free_huge_page_bytes_reads_orders_9_and_up(tmp_path) -> None:
    from zerospeed.accelerator.huge_pages import free_huge_page_bytes

    info = tmp_path / "buddyinfo"
    info.write_text("Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3\n"
                    "Node 0, zone   Normal   1548   1887    433    426    307  10872   6284   2096   1157    471    280\n")
    assert free_huge_page_bytes(str(info)) == (1 * 2 + 3 * 4 + 471 * 2 + 280 * 4) << 20
    assert free_huge_page_bytes(str(tmp_path / "missing")) == 0


def test_references_taken_inside_gathered_parameters_stay_valid(tmp_path) -> None:
    """DeepSpeed-Chat's ZeRO-3 save builds a state dict inside the block and saves it after (issue 31, item 3)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model.load_state_dict(ref.state_dict())
    _partitioned(model)
    with GatheredParameters(model.parameters()):
        sd = {k: v for k, v in model.state_dict().items()}
        first = next(model.parameters()).data
    assert all(p.numel() == 0 for p in model.parameters())  # released
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, msg=k)
    torch.testing.assert_close(first, ref[0].weight.data)
    torch.save(sd, tmp_path / "sd.pt")
    loaded = torch.load(tmp_path / "sd.pt", weights_only=True)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(loaded[k], v, msg=k)
    with GatheredParameters(model.parameters()):  # a second block gathers into fresh buffers
        torch.testing.assert_close(next(model.parameters()).data, ref[0].weight.data)
    torch.testing.assert_close(sd["0.weight"], ref[0].weight.data)
