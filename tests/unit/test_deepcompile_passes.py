"""DeepCompile's graph passes on small hand-built FX graphs (the node order each produces) and its config keys.
(The private compiler surface it touches is pinned in tests/dist/test_deepcompile.py, where dynamo is loaded.)"""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
from torch import fx

from zerospeed.config import load_config
from zerospeed.config.compile import CompileConfig
from zerospeed.config.errors import ConfigError, NotSupportedYetError
from zerospeed.runtime.deepcompile import _passes, sync_points
from zerospeed.zero.stage3.graph_ops import GraphUnits
from zerospeed.zero.stage3.graph_passes import (GATHER, PREFETCH, PREFETCHED, REDUCE, SCHEDULE, check_schedule,
                                                prefetch, reduce_early, run_passes, schedule_digest,
                                                selective_units, sink_gathers)

BASE = {"train_batch_size": 2}


def _forward_graph(units: int) -> fx.Graph:
    """Traced shape: every gather (unpacked by getitem) at the top, then ``h = h @ w_k`` per unit."""
    g = fx.Graph()
    anchor, h = g.placeholder("anchor"), g.placeholder("x")
    weights = []
    for u in range(units):
        gathered = g.call_function(GATHER, (anchor, 7, u))
        weights.append(g.call_function(operator.getitem, (gathered, 0)))
    for w in weights:
        h = g.call_function(torch.ops.aten.mm.default, (h, w))
    g.output(h)
    return g


def _names(g: fx.Graph) -> list[str]:
    out = []
    for n in g.nodes:
        if n.target in (GATHER, PREFETCHED):
            out.append(f"g{n.args[2]}")
        elif n.target is PREFETCH:
            out.append("p" + "+".join(map(str, n.args[2])))
        elif n.target is torch.ops.aten.mm.default:
            out.append("mm")
    return out


def test_sink_moves_each_gather_to_its_first_use() -> None:
    g = _forward_graph(3)
    assert _names(g) == ["g0", "g1", "g2", "mm", "mm", "mm"]
    assert sink_gathers(g) == 3
    g.lint()
    assert _names(g) == ["g0", "mm", "g1", "mm", "g2", "mm"]


@pytest.mark.parametrize("window,expected", [
    (10, ["p1", "g0", "mm", "p2", "g1", "mm", "p3", "g2", "mm", "g3", "mm"]),  # one unit ahead
    (20, ["p1+2", "g0", "mm", "p3", "g1", "mm", "g2", "mm", "g3", "mm"]),  # two ahead: the first window is one launch
    (40, ["p1+2+3", "g0", "mm", "g1", "mm", "g2", "mm", "g3", "mm"]),  # the whole rest in one
    (0, ["g0", "mm", "g1", "mm", "g2", "mm", "g3", "mm"]),  # off
])
def test_prefetch_starts_gathers_ahead_within_the_window(window: int, expected: list[str]) -> None:
    g = _forward_graph(4)
    sink_gathers(g)
    assert prefetch(g, [10, 10, 10, 10], window) == sum(n.count("+") + 1 for n in expected if n.startswith("p"))
    g.lint()
    assert _names(g) == expected
    for n in g.nodes:  # each prefetched gather waits on the token of the prefetch that starts its unit
        if n.target is PREFETCHED:
            assert n.args[3].target is PREFETCH and n.args[2] in n.args[3].args[2]


def test_one_schedule_check_heads_the_graph_and_anchors_every_gather() -> None:
    g = _forward_graph(3)
    sink_gathers(g)
    prefetch(g, [10, 10, 10], 20)
    assert check_schedule(g) == 4  # g0, p1+2, g1, g2
    g.lint()
    ops = [n for n in g.nodes if n.target in (GATHER, PREFETCH, PREFETCHED)]
    (sched,) = [n for n in g.nodes if n.target is SCHEDULE]
    assert list(g.nodes).index(sched) < list(g.nodes).index(ops[0])
    assert all(n.args[0] is sched for n in ops)  # no compiler can run a gather before the check
    assert sched.args[2:] == (4, schedule_digest(ops)) and check_schedule(g) == 0  # once per graph
    # the digest names the sequence: another order of the same units is another schedule
    other = _forward_graph(3)
    first, second = [n for n in other.nodes if n.target is GATHER][:2]
    second.args, first.args = first.args, second.args
    assert schedule_digest([n for n in other.nodes if n.target is GATHER]) != schedule_digest(
        [n for n in _forward_graph(3).nodes if n.target is GATHER])
    assert check_schedule(fx.Graph()) == 0  # nothing gathered: no check


def test_prefetch_skips_a_unit_larger_than_the_window() -> None:
    g = _forward_graph(3)
    sink_gathers(g)
    prefetch(g, [10, 50, 10], 20)
    assert _names(g) == ["g0", "mm", "p2", "g1", "mm", "g2", "mm"]  # unit 1 (50) is gathered when needed


def test_reduce_hands_each_gradient_right_after_its_producer() -> None:
    """A unit's reduce is split: each gradient reaches the reducer as soon as it is final (a unit whose last
    gradient comes at the end of backward does not hold back the others), and the parts' results are summed
    into the anchor's gradient, so none is left without a user."""
    g = fx.Graph()
    g.placeholder("anchor")
    a, b = g.placeholder("a"), g.placeholder("b")
    grad_w = g.call_function(torch.ops.aten.mm.default, (a, b))
    later = g.call_function(torch.ops.aten.mm.default, (b, b))  # more backward, independent of grad_w
    grad_b = g.call_function(torch.ops.aten.sum.default, (later,))  # this unit's last gradient, late
    red = g.call_function(REDUCE, ([grad_w, None, grad_b], 7, 0))
    g.output((later, red))
    assert reduce_early(g) == 2
    g.lint()
    order = list(g.nodes)
    parts = [n for n in order if n.op == "call_function" and n.target is REDUCE]
    assert [p.args[0] for p in parts] == [[grad_w, None, None], [None, None, grad_b]]
    assert [p.args[1:] for p in parts] == [(7, 0), (7, 0)]
    assert order.index(parts[0]) == order.index(grad_w) + 1 < order.index(later)  # before the rest of backward
    assert order.index(parts[1]) == order.index(grad_b) + 1
    total = order[-1].args[0][1]
    assert total.target is torch.ops.aten.add.Tensor and set(total.args) == set(parts)
    assert red not in order


def test_a_single_gradient_reduce_moves_right_after_it() -> None:
    g = fx.Graph()
    g.placeholder("anchor")
    a, b = g.placeholder("a"), g.placeholder("b")
    grad_w = g.call_function(torch.ops.aten.mm.default, (a, b))
    later = g.call_function(torch.ops.aten.mm.default, (b, b))
    red = g.call_function(REDUCE, ([grad_w, None], 7, 0))
    g.output((later, red))
    assert reduce_early(g) == 1
    order = list(g.nodes)
    assert order.index(red) == order.index(grad_w) + 1 < order.index(later)
    assert reduce_early(g) == 0  # already in place


def test_run_passes_composes_and_selective_gather_keeps_the_last_units() -> None:
    g = _forward_graph(3)
    assert run_passes(g, ("release", "prefetch", "reduce"), [5, 5, 5], 5) == {"sink": 3, "prefetch": 2, "reduce": 0,
                                                                              "schedule": 5}
    assert selective_units([4, 4, 4, 4], 9) == {2, 3}
    assert selective_units([4, 4, 4, 10], 9) == set()  # the last unit does not fit: none kept
    assert selective_units([4, 4], 10 ** 9) == {0, 1}


def _Cfg(passes: list[str] | None, **keys: bool) -> CompileConfig:
    return CompileConfig(deepcompile=True, passes=passes, **keys)  # type: ignore[arg-type]


def test_pass_names_and_schedule() -> None:
    assert _passes(None, _Cfg(None), True) == ("zero3_compile", "prefetch", "selective_gather")  # type: ignore[arg-type]
    assert _passes([(0, ["zero3_compile"])], _Cfg(["z3"]), True) == ("zero3_compile",)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"compile\.passes.*\[\"z3\"\]"):
        _passes(None, _Cfg(["z1"]), True)  # type: ignore[arg-type]
    with pytest.raises(NotSupportedYetError, match="autotp"):
        _passes(None, _Cfg(["autotp"]), True)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="after 0"):
        _passes([(0, ["zero3_compile"]), (10, ["prefetch"])], _Cfg(None), True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown DeepCompile pass 'prefetch'.*zero1_compile"):
        _passes([(0, ["prefetch"])], _Cfg(None), False)  # type: ignore[arg-type]
    # an offload pass runs in place of prefetch and selective gather (as in DeepSpeed), or after a given schedule
    assert _passes(None, _Cfg(None, offload_opt_states=True), True) == ("zero3_compile", "offload_adam_states")
    assert _passes(None, _Cfg(None, offload_activation=True), True) == ("zero3_compile", "offload_activation")
    assert _passes([(0, ["zero3_compile", "prefetch"])], _Cfg(None, offload_parameters=True), True) == \
        ("zero3_compile", "prefetch", "offload_parameters")


def test_deepcompile_keys_read_hinted_or_refused() -> None:
    cfg = load_config({**BASE, "compile": {"deepcompile": True, "debug_log": True, "passes": ["z3"],
                                           "sync_before_reduce": True, "double_buffer": False,
                                           "keep_all_input_tensors": True}})
    assert cfg.compile.deepcompile and cfg.compile.debug_log and cfg.compile.sync_before_reduce
    with pytest.warns(UserWarning, match=r"compile\.debug_log has no effect without compile\.deepcompile"):
        load_config({**BASE, "compile": {"debug_log": True}})
    assert load_config({**BASE, "compile": {"deepcompile": True, "symmetric_memory": True}}).compile.symmetric_memory
    for key in ("offload_parameters", "offload_opt_states", "offload_activation"):  # read: deepcompile.py
        assert getattr(load_config({**BASE, "compile": {"deepcompile": True, key: True}}).compile, key)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({**BASE, "compile": {"deepcompile": True, "debug_log": True}})  # no warning with deepcompile


def test_sync_keys_synchronise_at_their_points() -> None:
    cfg = load_config({**BASE, "compile": {"deepcompile": True, "sync_before_reduce": True,
                                           "sync_after_allgather": True}}).compile
    assert sync_points(cfg) == {"before_reduce", "after_allgather"}
    calls = []
    g = GraphUnits([], lambda p, grad: None)
    g.sync_points, g.synchronize = sync_points(cfg), lambda: calls.append(1)
    for point in ("before_allgather", "after_allgather", "before_reduce", "after_reduce"):
        g.sync(point)
    assert len(calls) == 2


def test_graph_break_notes_name_hugging_face_warning_once_and_are_added_once() -> None:
    from zerospeed.zero.stage3.graph_forward import GRAPH_BREAK_HINT, HF_WARNING_ONCE_HINT, graph_break_notes

    plain = RuntimeError("Attempted to call function marked as skipped: print")
    assert graph_break_notes(plain) == [GRAPH_BREAK_HINT]
    hf = RuntimeError("lru_cache ... from user code: File \"transformers/modeling_utils.py\", in loss_function\n"
                      "    logger.warning_once(")
    assert graph_break_notes(hf) == [GRAPH_BREAK_HINT, HF_WARNING_ONCE_HINT]
    assert "loss_type" in HF_WARNING_ONCE_HINT and "use_cache" in HF_WARNING_ONCE_HINT
    for note in graph_break_notes(hf):
        hf.add_note(note)
    assert graph_break_notes(hf) == []  # a re-raised error is not annotated twice



def test_symmetric_memory_is_refused_with_its_reason_off_cuda_and_ignored_below_stage_3() -> None:
    """compile.symmetric_memory: read where DeepCompile builds (runtime/deepcompile.symmetric_gathers); a CPU engine's
    groups have no symmetric memory, so engine.compile() refuses it naming why; below stage 3 the graph gathers
    nothing (a warning); off, nothing is enabled."""
    from types import SimpleNamespace

    from zerospeed.config import ConfigError
    from zerospeed.runtime.deepcompile import symmetric_gathers

    on = load_config({**BASE, "compile": {"deepcompile": True, "symmetric_memory": True}}).compile
    cpu = SimpleNamespace(shards=[SimpleNamespace(group=None, device=torch.device("cpu"), world=2)])
    with pytest.raises(ConfigError, match=r"compile\.symmetric_memory.*CUDA peer-to-peer memory; this engine's "
                                          r"device is 'cpu'.*Set it to false"):
        symmetric_gathers(on, cpu)
    with pytest.warns(UserWarning, match="no effect below ZeRO stage 3"):
        assert symmetric_gathers(on, None) == []
    off = load_config({**BASE, "compile": {"deepcompile": True}}).compile
    assert symmetric_gathers(off, cpu) == []
    alone = SimpleNamespace(shards=[SimpleNamespace(group=None, device=torch.device("cpu"), world=1)])
    with pytest.raises(ConfigError, match="this engine's device is 'cpu'"):  # one rank on CPU: refused all the same
        symmetric_gathers(on, alone)
