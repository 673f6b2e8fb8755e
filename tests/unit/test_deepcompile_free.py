"""DeepCompile's release of saved activations in the compiled backward (zero/stage3/graph_free.py): the boxed
runner drops each input at its last use, and the free_activation pass frees large saved activations there."""

from __future__ import annotations

import operator
import weakref

import pytest
import torch
from torch import fx

from zerospeed.config import load_config
from zerospeed.zero.stage3.graph_free import add_free_activations, boxed, free_activations

MM = torch.ops.aten.mm.default


def _backward_graph(probe: object) -> fx.Graph:
    """A backward's shape: forward inputs, two saved activations (one large, one small), an incoming gradient;
    ``probe(x)`` runs after the large activation's last use."""
    g = fx.Graph()
    primal, big, small, tangent = (g.placeholder(n) for n in ("primals_1", "mm_1", "relu_2", "tangents_1"))
    vals = {primal: torch.empty(4, 4), big: torch.empty(64, 4), small: torch.empty(4, 4), tangent: torch.empty(4, 4)}
    for node, val in vals.items():
        node.meta["val"] = val
    a = g.call_function(MM, (big, primal))  # the large activation's only use
    b = g.call_function(operator.mul, (tangent, small))
    c = g.call_function(probe, (b,))  # type: ignore[arg-type]
    d = g.call_function(operator.add, (c, small))  # the small activation's last use
    g.output((a, d, primal))
    return g


def test_boxed_runner_drops_each_input_at_its_last_use() -> None:
    alive: list[bool] = []
    args = [torch.ones(4, 4), torch.ones(64, 4), torch.ones(4, 4), torch.ones(4, 4)]
    big = weakref.ref(args[1])
    g = _backward_graph(lambda x: alive.append(big() is not None) or x)
    a, d, primal = boxed(fx.GraphModule(torch.nn.Module(), g))(args)
    assert args == []  # the boxed convention: the list is cleared
    assert alive == [False]  # dead before the graph returned (a plain f(*args) call keeps it: [True])
    assert a.shape == (64, 4) and torch.equal(d, torch.full((4, 4), 2.0)) and primal.shape == (4, 4)


def test_free_activation_pass_frees_large_saved_activations_after_their_last_use() -> None:
    seen: list[int] = []
    g = _backward_graph(lambda x: x)
    freed = add_free_activations(g, threshold=64 * 4 * 4)  # the large one (1 KiB) only
    g.lint()
    assert freed == [["mm_1"]]
    order = [n.target for n in g.nodes if n.op == "call_function"]
    assert order[:2] == [MM, free_activations]  # right after its last use
    assert add_free_activations(_backward_graph(lambda x: x), threshold=0) == [["mm_1"], ["relu_2"]]  # not primals/tangents
    big = torch.ones(64, 4)
    held = [big]  # a reference outside the graph: the pass empties the graph's tensor all the same

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(held[0].numel())
        return x

    g = _backward_graph(probe)
    add_free_activations(g, threshold=0)
    boxed(fx.GraphModule(torch.nn.Module(), g))([torch.ones(4, 4), big, torch.ones(4, 4), torch.ones(4, 4)])
    assert seen == [0]


def test_free_activation_keys() -> None:
    cfg = load_config({"train_batch_size": 2, "compile": {"deepcompile": True, "free_activation": True,
                                                          "free_activation_threshold": 0}}).compile
    assert cfg.free_activation and cfg.free_activation_threshold == 0
    with pytest.warns(UserWarning, match=r"compile\.free_activation has no effect without compile\.deepcompile"):
        load_config({"train_batch_size": 2, "compile": {"free_activation": True}})
    with pytest.raises(Exception, match="free_activation_threshold"):
        load_config({"train_batch_size": 2, "compile": {"deepcompile": True, "free_activation_threshold": -1}})


def test_an_output_given_no_gradient_costs_no_full_zero_in_the_compiled_backward() -> None:
    """The model returns (logits, loss) and only the loss is backpropagated: autograd would hand the compiled
    backward a full zero for the logits (196 MiB on GPT-2 small); with defer_zero_grads it hands None, which the
    boxed runner turns into a one-element zero. Gradients are unchanged."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from zerospeed.zero.stage3.graph_free import defer_zero_grads

    seen: list[tuple[int, ...]] = []

    def bw_compiler(gm: fx.GraphModule, example_inputs: object) -> object:
        run = boxed(gm, lazy_tangents=True)
        tangents = [i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")
                    if n.name.startswith("tangents")]

        def probe(args: list) -> object:  # what autograd hands the compiled backward
            seen.extend(tuple(args[i].stride()) if args[i] is not None else (-1,) for i in tangents)
            return run(args)

        probe._boxed_call = True  # type: ignore[attr-defined]
        return probe

    backend = aot_autograd(fw_compiler=lambda gm, _: boxed(gm), bw_compiler=bw_compiler,
                           partition_fn=min_cut_rematerialization_partition)

    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = x @ w
        return logits, logits.logsumexp(-1).mean()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    x = torch.randn(3, 4)
    w_ref = torch.randn(4, 5, requires_grad=True)
    w = w_ref.detach().clone().requires_grad_(True)
    f(x, w_ref)[1].backward()
    out = compiled(x, w)
    assert defer_zero_grads(out) == 1  # one backward node for both outputs
    out[1].backward()
    torch.testing.assert_close(w.grad, w_ref.grad)
    # autograd handed None for the logits (no full zero; the runner made a stride-0 one), the loss's scalar as is
    assert seen == [(-1,), ()], seen
    torch._dynamo.reset()
