"""The root forward of a ZeRO-3 model under DeepCompile: gathers as graph ops, the model run on their values.

``GraphForward(module, graph)`` replaces stage 3's module hooks (``hooks.py``, which are graph breaks):

1. each unit's parameters come whole from one ``zerospeed::z3_gather`` (``graph_ops.py``), in unit order
   (``named_modules()`` order; a tied parameter in its first unit); a frozen parameter's value is detached;
2. the module runs on those values in place of its (empty, partitioned) parameters, every name of a tied
   parameter included (``torch.nn.utils.stateless._reparametrize_module``, the swap under
   ``torch.func.functional_call``; called directly because ``functional_call`` re-enters ``module.__call__``,
   which is this forward once compiled);
3. with grad enabled, the whole call is one selective activation checkpoint (``torch.utils.checkpoint`` with
   ``create_selective_checkpoint_contexts``) whose policy recomputes every ``z3_gather`` (but those of the
   units that selective gather keeps) and saves everything else: autograd does not keep a gathered
   parameter from forward to backward; the backward gathers it again where it is needed, and the compiled
   code frees each value after its last use.

Traced by Dynamo, the whole model is one graph with no break at module boundaries; run eagerly, it does the
same operations. Graph passes (``runtime/graph_passes.py``) then place the gathers and reductions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .graph_free import defer_zero_grads
from .graph_ops import GraphUnits
from .param_store import shard_of

z3_gather_op = torch.ops.zerospeed.z3_gather.default

GRAPH_BREAK_HINT = (
    "zerospeed DeepCompile (compile.deepcompile: true) compiles the whole model as one graph (fullgraph=True), so "
    "code that breaks the graph is an error here. zerospeed.checkpointing regions run eagerly by design and are "
    "not supported yet under DeepCompile: use torch.utils.checkpoint.checkpoint(..., use_reentrant=False) in the "
    "model, or compile without compile.deepcompile (stage 3's hooks are then graph breaks)")

HF_WARNING_ONCE_HINT = (
    "The break is Hugging Face's logger.warning_once (an lru_cache, which dynamo cannot trace), called on every "
    "step by two model habits: a model class whose loss_type HF does not recognise (GPT2LMHeadModel: set "
    "model.loss_type = \"ForCausalLM\", the loss HF falls back to anyway), and use_cache=True with activation "
    "checkpointing (set model.config.use_cache = False)")


def graph_break_notes(exc: BaseException) -> list[str]:
    """The notes DeepCompile adds to a graph-break error: what fullgraph means here, and a known model-side
    cause when the message names one."""
    notes = [GRAPH_BREAK_HINT]
    text = str(exc)
    if "warning_once" in text or ("lru_cache" in text and "transformers" in text):
        notes.append(HF_WARNING_ONCE_HINT)
    return [n for n in notes if n not in getattr(exc, "__notes__", [])]


def _policy(keep: frozenset[int], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Gathers are recomputed in backward, but for the units selective gather keeps; so are views (free to
    recompute: a saved ``W.t()`` would keep the whole gathered weight alive); the rest is saved."""
    if op is z3_gather_op:
        return CheckpointPolicy.MUST_SAVE if args[2] in keep else CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_RECOMPUTE if getattr(op, "is_view", False) else CheckpointPolicy.PREFER_SAVE


def _forward_side_effects_once() -> Any:
    """Dynamo's setting under which code inside a traced checkpoint may change state outside it (its
    ``skip_fwd_side_effects_in_bwd_under_checkpoint``): the change happens in the forward and is not replayed
    when the backward recomputes. The checkpoint around the whole model is zerospeed's (step 3 of the module
    docstring), not the user's, so a model's side effects must happen once per forward, as they do without it.
    Without the setting, dynamo refuses any: Hugging Face's ``kernels`` (a dependency of transformers 5.25)
    wraps every Llama attention forward in a set/reset of a global (``CompileableContextVar``)."""
    import torch._dynamo.config as dynamo_config

    return dynamo_config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


class GraphForward:
    """Callable standing for ``module.__call__`` (installed as its ``_compiled_call_impl``)."""

    def __init__(self, module: nn.Module, graph: GraphUnits, keep: frozenset[int] = frozenset(),
                 lazy_tangents: bool = False) -> None:
        """``keep``: units kept gathered from forward to backward (the selective gather pass);
        ``lazy_tangents``: the compiled backward takes None for an output given no gradient
        (``graph_free.defer_zero_grads``; zerospeed's ``aot_eager`` runner)."""
        self.module = module
        self.lazy_tangents = lazy_tangents
        self.graph = graph
        self.keep = keep
        self.before_forward: list[Callable[[], None]] = []  # run before each training forward (offload_opt_states)
        self._contexts = functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, keep))
        device = graph.units[0][0].device if graph.units else torch.device("cpu")
        self.anchor = torch.zeros(1, device=device, requires_grad=True)  # see graph_ops.py
        names: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            s = shard_of(p)
            if s is not None:
                names.setdefault(id(s), []).append(name)
        # per unit: (unit index, [(names of the shard, trainable)])
        self.plan = [(i, [(names.get(id(s), []), s.param.requires_grad) for s in shards])
                     for i, shards in enumerate(graph.units)]

    def gathered(self) -> dict[str, torch.Tensor]:
        values: dict[str, torch.Tensor] = {}
        for index, shards in self.plan:
            fulls = torch.ops.zerospeed.z3_gather(self.anchor, self.graph.handle, index)
            for full, (names, trainable) in zip(fulls, shards):
                value = full if trainable else full.detach()
                values.update((n, value) for n in names)
        return values

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        with _reparametrize_module(self.module, self.gathered()):
            return self.module._call_impl(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """What the compiler traces."""
        if not torch.is_grad_enabled():
            return self._run(*args, **kwargs)
        return checkpoint(self._run, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.anchor.grad = None  # its gradient is a token (zero); do not let it pile up
        self.graph.covered = 0  # nothing left over from a graph that raised (graph_ops.GraphUnits.covering)
        if torch.is_grad_enabled():
            for hook in self.before_forward:
                hook()
        try:
            with _forward_side_effects_once():
                out = self.run(*args, **kwargs)
        except Exception as exc:
            from torch._dynamo.exc import Unsupported  # loaded: the compiled call raised

            if isinstance(exc, Unsupported):
                for note in graph_break_notes(exc):
                    exc.add_note(note)
            raise
        if self.lazy_tangents:
            defer_zero_grads(out)
        return out

    run = forward  # replaced by the compiled forward (runtime/compile.py)


__all__ = ["GraphForward", "graph_break_notes"]
