"""Tiled compute over the sequence (Arctic Long Sequence Training): one shard's activations live at a time.

A position-wise function (an MLP, the LM head + loss) run on a ``[batch, seq, hidden]`` input needs its
intermediates for every token at once (an MLP widens each token 4x and keeps two such tensors for backward).
Cut the sequence into shards and run the function shard by shard without a graph; in backward, run each
shard again under autograd and backpropagate it at once, so only one shard's intermediates exist at a time.
The price is one more forward of the function. Interfaces are DeepSpeed's
(``deepspeed.runtime.sequence_parallel.ulysses_sp``):

* ``TiledMLP.apply(fn, self, x, shards, compute_params)`` calls ``fn(self, x_shard)`` per shard along dim -2;
* ``sequence_tiled_compute(fn, seqlen, shards, kwargs_to_shard, kwargs_to_pass, grad_requiring_tensor_key,
  compute_params, output_unshard_dimension, output_reduction)`` is the general form (shards on dim 1);
* ``TiledFusedLogitsLoss`` (in ``tiled_loss.py``) never materialises ``[seq, vocab]`` logits.

Shards are DeepSpeed's cut (see :func:`shard_bounds`): a sequence that does not divide evenly gets a shorter
last shard. Parameter gradients: DeepSpeed accumulates each shard's weight gradient into ``.grad`` and tells
its ZeRO not to reduce until the last shard (``ds_grad_is_ready``). Here the gradients of the parameters of
``self`` and of ``compute_params`` are summed over shards inside the tiled function and handed to autograd
once, as the function's own input gradients: gradient hooks (any ZeRO stage's reducer, DDP) fire once per
parameter per backward, and a weight used elsewhere too (a tied embedding) is accumulated once with its
other uses. Any other leaf the function uses is found in the shard's graph and gets its gradient by one
nested ``backward`` at the end. The RNG state is replayed for the recompute, so dropout inside ``fn`` draws
the same masks both times. Only the grad-requiring input and parameters get gradients: other tensors passed
to ``fn`` are detached. Under ZeRO stage 3 the listed parameters are gathered (:func:`gathered`)
around the tiled forward and the recompute, so autograd sees their full shapes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from itertools import chain
from typing import Any

import torch
from torch import nn

__all__ = ["SequenceTiledCompute", "TiledMLP", "sequence_tiled_compute", "shard_bounds"]

REDUCTIONS = (None, "mean", "sum")
_STAGE3_GATHERED = "zerospeed.zero.stage3.gathered"


def shard_bounds(length: int, shards: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each shard: DeepSpeed's cut, ``step = ceil(length / shards)``, empty shards dropped.

    ``shard_bounds(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]``; ``shard_bounds(6, 4)`` gives 3 shards of 2
    (as ``torch.chunk`` does). A zero length gives one empty shard.
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if length == 0:
        return [(0, 0)]
    step = -(-length // shards)
    return [(start, min(start + step, length)) for start in range(0, length, step)]


def gathered(params: Sequence[torch.Tensor]) -> AbstractContextManager[Any]:
    """ZeRO stage 3's ``GatheredParameters(params)`` when stage 3 is loaded (only then can a parameter be
    partitioned), else nothing. Looked up, not imported: models using tiling stay free of ``zero``."""
    stage3 = sys.modules.get(_STAGE3_GATHERED)
    return stage3.GatheredParameters(params) if stage3 is not None else nullcontext()


def trainable_params(module: Any, compute_params: Iterable[torch.Tensor] | None) -> list[torch.Tensor]:
    """Parameters needing a gradient: those of ``module`` (if a Module) and ``compute_params``, each once."""
    found: dict[int, torch.Tensor] = {}
    own = module.parameters() if isinstance(module, nn.Module) else ()
    for p in chain(own, compute_params or ()):
        if isinstance(p, torch.Tensor) and p.requires_grad:
            found.setdefault(id(p), p)
    return list(found.values())


def _graph_leaves(output: torch.Tensor) -> list[torch.Tensor]:
    """Leaf tensors (``AccumulateGrad`` nodes) that ``output``'s graph reaches."""
    leaves: dict[int, torch.Tensor] = {}
    stack, seen = [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.setdefault(id(variable), variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())


class ShardGrads:
    """Sums parameter gradients over shards; hands back the grad-requiring input's gradient per shard.

    ``params`` get their sums back through :meth:`param_grads` (returned by the autograd function as
    input gradients); leaves found in a shard's graph beyond ``params`` are summed too and delivered by
    :meth:`deliver_others` (one nested backward).
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.sums: list[torch.Tensor | None] = [None] * len(self.params)
        self.others: list[torch.Tensor] | None = None  # learned from the first shard's graph
        self.other_sums: list[torch.Tensor | None] = []

    def backward(self, output: torch.Tensor, grad_output: torch.Tensor, wrt: torch.Tensor | None
                 ) -> torch.Tensor | None:
        """Gradient of ``<output, grad_output>`` for ``wrt`` (returned; None if not needed), params summed."""
        if not output.requires_grad:
            return None
        if self.others is None:
            known = {id(p) for p in self.params} | ({id(wrt)} if wrt is not None else set())
            self.others = [t for t in _graph_leaves(output) if t.requires_grad and id(t) not in known]
            self.other_sums = [None] * len(self.others)
        lead = [wrt] if wrt is not None and wrt.requires_grad else []
        targets = lead + self.params + self.others
        grads = torch.autograd.grad(output, targets, grad_output, allow_unused=True)
        tail = grads[len(lead):]
        _add_into(self.sums, tail[: len(self.params)])
        _add_into(self.other_sums, tail[len(self.params):])
        return grads[0] if lead else None

    def param_grads(self, scale: torch.Tensor | None = None) -> list[torch.Tensor | None]:
        return [g if g is None or scale is None else g * scale for g in self.sums]

    def deliver_others(self, scale: torch.Tensor | None = None) -> None:
        pairs = [(t, g if scale is None else g * scale) for t, g in zip(self.others or [], self.other_sums)
                 if g is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def _add_into(sums: list[torch.Tensor | None], grads: Sequence[torch.Tensor | None]) -> None:
    for i, g in enumerate(grads):
        if g is not None:
            sums[i] = g if sums[i] is None else sums[i] + g  # out of place: g may alias a caller's tensor


def _write(region: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Put one shard's input gradient into its region of the full gradient (zeros if it had none)."""
    if grad is None:
        region.zero_()
    else:
        region.copy_(grad)


class RngReplay:
    """The RNG state at the start of a tiled forward, restored for its recompute (same dropout masks)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda_device = device.index if device.type == "cuda" else None
        if self.cuda_device is None and device.type == "cuda":
            self.cuda_device = torch.cuda.current_device()
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(self.cuda_device) if self.cuda_device is not None else None

    @contextmanager
    def replayed(self) -> Iterator[None]:
        devices = [self.cuda_device] if self.cuda_device is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.cuda_device)
            yield


# --- TiledMLP ------------------------------------------------------------------------------------------
class _TiledMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], module: Any, shards: int, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.module = fn, module
        ctx.bounds = shard_bounds(x.shape[-2], shards)
        ctx.rng = RngReplay(x.device)
        ctx.save_for_backward(x, *params)
        out: torch.Tensor | None = None
        for a, b in ctx.bounds:  # each shard written into the output at once: no second copy for a cat
            shard = fn(module, x.narrow(-2, a, b - a))
            if out is None:
                shape = (*shard.shape[:-2], x.shape[-2], shard.shape[-1])
                out = torch.empty(shape, dtype=shard.dtype, device=shard.device)
            out.narrow(-2, a, b - a).copy_(shard)
        assert out is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *params = ctx.saved_tensors
        x = x.detach()
        need_x = ctx.needs_input_grad[3]
        x_grad = torch.empty_like(x) if need_x else None
        sink = ShardGrads([p for p, need in zip(params, ctx.needs_input_grad[4:]) if need])
        with ctx.rng.replayed(), gathered(params):
            for a, b in ctx.bounds:
                x_shard = x.narrow(-2, a, b - a).detach().requires_grad_(need_x)
                with torch.enable_grad():
                    out = ctx.fn(ctx.module, x_shard)
                g = sink.backward(out, grad_out.narrow(-2, a, b - a), x_shard)
                if x_grad is not None:
                    _write(x_grad.narrow(-2, a, b - a), g)
        sink.deliver_others()
        summed = iter(sink.param_grads())
        param_grads = [next(summed) if need else None for need in ctx.needs_input_grad[4:]]
        return (None, None, None, x_grad, *param_grads)


class TiledMLP:
    """Run ``fn(self, x)`` on shards of ``x`` along dim -2 (the sequence) and recompute them in backward.

    DeepSpeed's call: ``TiledMLP.apply(fn, self, x, shards, compute_params)``; ``x`` is ``[..., seq, hidden]``
    and ``fn`` must be position-wise (each output row depends only on the same input row). Activation memory
    is one shard's; ``fn`` runs twice. ``compute_params`` may be None: the parameters of ``self`` are always
    included (DeepSpeed needs the list only for its ZeRO's gradient timing).
    """

    @staticmethod
    def apply(fn: Callable[..., torch.Tensor], self: Any, x: torch.Tensor, shards: int,
              compute_params: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"TiledMLP needs x with a sequence dimension ([..., seq, hidden]); got shape "
                             f"{tuple(x.shape)}")
        params = trainable_params(self, compute_params)
        with gathered(params):
            return _TiledMLPFunction.apply(fn, self, int(shards), x, *params)


# --- sequence_tiled_compute ------------------------------------------------------------------------------
class _SequenceTiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], bounds: list[tuple[int, int]], keys: list[str],
                grad_key: str, passed: dict[str, Any], out_dim: int, n_sharded: int, *tensors: torch.Tensor
                ) -> torch.Tensor:
        ctx.fn, ctx.bounds, ctx.keys, ctx.grad_key, ctx.passed = fn, bounds, keys, grad_key, passed
        ctx.out_dim, ctx.n_sharded = out_dim, n_sharded
        ctx.rng = RngReplay(tensors[0].device)
        ctx.save_for_backward(*tensors)
        sharded = dict(zip(keys, tensors[:n_sharded]))
        outs = [fn(**{k: v[:, a:b] for k, v in sharded.items()}, **passed) for a, b in bounds]
        ctx.out_sizes = [1 if out_dim == 0 else o.shape[out_dim] for o in outs]
        return torch.stack(outs) if out_dim == 0 else torch.cat(outs, dim=out_dim)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        sharded = {k: v.detach() for k, v in zip(ctx.keys, saved[: ctx.n_sharded])}
        params = saved[ctx.n_sharded:]
        gi = ctx.keys.index(ctx.grad_key)
        need_x = ctx.needs_input_grad[7 + gi]
        x = sharded[ctx.grad_key]
        x_grad = torch.empty_like(x) if need_x else None
        need_params = ctx.needs_input_grad[7 + ctx.n_sharded:]
        sink = ShardGrads([p for p, need in zip(params, need_params) if need])
        offset = 0
        with ctx.rng.replayed(), gathered(params):
            for i, (a, b) in enumerate(ctx.bounds):
                kwargs = {k: v[:, a:b] for k, v in sharded.items()}
                kwargs[ctx.grad_key] = kwargs[ctx.grad_key].detach().requires_grad_(need_x)
                with torch.enable_grad():
                    out = ctx.fn(**kwargs, **ctx.passed)
                size = ctx.out_sizes[i]
                g_out = grad_out[i] if ctx.out_dim == 0 else grad_out.narrow(ctx.out_dim, offset, size)
                offset += size
                g = sink.backward(out, g_out, kwargs[ctx.grad_key])
                if x_grad is not None:
                    _write(x_grad[:, a:b], g)
        sink.deliver_others()
        grads: list[torch.Tensor | None] = [None] * ctx.n_sharded
        grads[gi] = x_grad
        summed = iter(sink.param_grads())
        return (None,) * 7 + tuple(grads) + tuple(next(summed) if need else None for need in need_params)


def sequence_tiled_compute(
    fn: Callable[..., torch.Tensor],
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict[str, torch.Tensor],
    kwargs_to_pass: dict[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Iterable[torch.Tensor] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> torch.Tensor:
    """Run ``fn(**shard_of(kwargs_to_shard), **kwargs_to_pass)`` over ``shards`` slices of dim 1 (DeepSpeed's API).

    Every ``kwargs_to_shard`` value is ``[batch, seqlen, ...]``. Shard outputs are concatenated on
    ``output_unshard_dimension`` (0: each shard returns a scalar, stacked), then ``output_reduction`` (None,
    "mean" or "sum") is applied. Backward recomputes shard by shard; the gradient goes to
    ``kwargs_to_shard[grad_requiring_tensor_key]`` and to the parameters ``fn`` uses (list them in
    ``compute_params`` so a weight also used elsewhere is accumulated once).
    """
    if output_reduction not in REDUCTIONS:
        raise ValueError(f"unknown output_reduction {output_reduction!r}: valid values are None, 'mean', 'sum'")
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not one of kwargs_to_shard "
                         f"({sorted(kwargs_to_shard)})")
    for key, value in kwargs_to_shard.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != seqlen:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"kwargs_to_shard[{key!r}] must be a [batch, seqlen={seqlen}, ...] tensor, got {shape}")
    keys = list(kwargs_to_shard)
    sharded = [kwargs_to_shard[k] if k == grad_requiring_tensor_key else kwargs_to_shard[k].detach() for k in keys]
    passed = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs_to_pass.items()}
    params = trainable_params(None, compute_params)
    with gathered(params):
        out = _SequenceTiledFunction.apply(fn, shard_bounds(seqlen, shards), keys, grad_requiring_tensor_key,
                                           passed, output_unshard_dimension, len(keys), *sharded, *params)
    if output_reduction == "mean":
        return out.mean()
    if output_reduction == "sum":
        return out.sum()
    return out


class SequenceTiledCompute:
    """DeepSpeed's ``SequenceTiledCompute.apply(fn, seqlen, shards, keys_to_shard, keys_to_pass,
    grad_requiring_tensor_key, compute_params, output_unshard_dimension, output_reduction, *args)``; the
    positional ``args`` are the values of ``keys_to_shard`` then ``keys_to_pass``. See :func:`sequence_tiled_compute`.
    """

    @staticmethod
    def apply(fn: Callable[..., torch.Tensor], seqlen: int, shards: int, keys_to_shard: Sequence[str],
              keys_to_pass: Sequence[str], grad_requiring_tensor_key: str,
              compute_params: Iterable[torch.Tensor] | None, output_unshard_dimension: int,
              output_reduction: str | None, *args: Any) -> torch.Tensor:
        if len(args) != len(keys_to_shard) + len(keys_to_pass):
            raise ValueError(f"expected {len(keys_to_shard) + len(keys_to_pass)} positional values (keys_to_shard "
                             f"then keys_to_pass), got {len(args)}")
        to_shard = dict(zip(keys_to_shard, args[: len(keys_to_shard)]))
        to_pass = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        return sequence_tiled_compute(fn, seqlen, shards, to_shard, to_pass, grad_requiring_tensor_key,
                                      compute_params, output_unshard_dimension, output_reduction)
