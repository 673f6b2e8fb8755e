"""AutoTP: split a whole model for tensor-parallel training, and ``tp_model_init``.

``tp_model_init(model, tp_size, dtype, config=None)`` records the request on the model (as DeepSpeed 0.19.8,
the split happens in ``initialize``, where the request is merged with the ``tensor_parallel`` section and
conflicts are errors). ``autotp_shard(model, tp_group, section)`` does the split itself, on every rank of
the group: the layers ``policy.plan_model`` places become ``LinearLayer`` (column) or ``LinearAllreduce``
(row) over ``tp_group``, keeping this rank's shard of the same Parameter objects; Hugging Face ``Conv1D``
weights are stored transposed first (``[out, in]``, as ``nn.Linear``), which the checkpoint export undoes.
Attention modules whose head bookkeeping lives in attributes (GPT-2's ``split_size`` / ``num_heads``) get
their local values. The result is a :class:`TensorParallelModel` record kept on the module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ... import comm
from ...config.tensor_parallel import TensorParallelConfig
from .autotp_config import PartitionType, resolve_partition_config
from .hf_tp_plan import plan_config
from .policy import Placement, is_conv1d, plan_model

REQUEST_ATTR = "_zerospeed_tp_request"
STATE_ATTR = "_zerospeed_tp"
_SP_MODEL_TYPES = (None, "gpt2", "llama", "qwen2", "mistral")
# Attention modules that read the sequence length from their input (``hidden_states.shape[:-1]``): under
# sequence parallelism their input is gathered to the whole sequence at entry instead of in each q/k/v layer.
_SHAPE_READING_ATTENTION = ("self_attn",)
"""Models whose attention takes its shapes from the q/k/v projections (which see the whole sequence)."""
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class TensorParallelModel:
    """What AutoTP did to a model: its group, and per split parameter its layout (``TPShardSpec``)."""

    group: Any
    size: int
    rank: int
    plan: dict[str, Placement]
    specs: dict[str, Any] = field(default_factory=dict)
    """Parameter name -> ``TPShardSpec`` for every parameter of a split layer (``dim=None``: replicated)."""
    transposed: set[str] = field(default_factory=set)
    """Weights stored ``[out, in]`` here but ``[in, out]`` in the original model (Hugging Face ``Conv1D``)."""
    sequence_parallel: Any = None
    """The gradient all-reduce of the replicated parameters inside the sequence-parallel region (or None)."""

    def split_params(self, model: nn.Module) -> set[int]:
        """ids of the parameters whose elements differ across the group (their shards)."""
        return {id(p) for n, p in model.named_parameters() if n in self.specs and self.specs[n].dim is not None}


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None, **kwargs: Any) -> nn.Module:
    """DeepSpeed's ``deepspeed.tp_model_init``: record tensor-parallel arguments; ``initialize`` applies them.

    ``config`` (a ``tensor_parallel`` dict, or a whole DeepSpeed config holding one) is merged with the
    engine config; ``tp_group`` (keyword) uses an existing group instead of the one ``initialize`` makes.
    """
    if int(tp_size) < 1:
        raise ValueError(f"tp_model_init: tp_size must be >= 1, got {tp_size}")
    unknown = set(kwargs) - {"tp_group"}
    if unknown:
        raise TypeError(f"tp_model_init() got unexpected arguments: {sorted(unknown)}")
    if getattr(model, STATE_ATTR, None) is not None:
        raise ValueError("tp_model_init: this model is already split for tensor parallelism")
    section = dict(config.get("tensor_parallel", config)) if isinstance(config, dict) else {}
    setattr(model, REQUEST_ATTR, {"tp_size": int(tp_size), "dtype": dtype, "section": section,
                                  "tp_group": kwargs.get("tp_group")})
    return model


def merge_request(model: nn.Module, section: TensorParallelConfig) -> tuple[TensorParallelConfig, torch.dtype | None, Any]:
    """The engine's ``tensor_parallel`` section with the ``tp_model_init`` request folded in (mismatch: error)."""
    req = getattr(model, REQUEST_ATTR, None)
    if req is None:
        dtype = _DTYPES.get(section.dtype) if section.dtype else None
        return section, dtype, None
    data = section.model_dump(by_alias=False)
    for k, v in req["section"].items():
        data.setdefault(k, v)
    size = req["tp_size"]
    for key, have in (("autotp_size", section.autotp_size), ("tp.tp_size", section.tp.tp_size)):
        if have > 1 and have != size:
            raise ValueError(f"tensor_parallel.{key} is {have} in the config but tp_model_init asked for {size}")
    data["autotp_size"] = size
    merged = TensorParallelConfig.model_validate(data)
    if section.dtype and _DTYPES[section.dtype] != req["dtype"]:
        raise ValueError(f"tensor_parallel.dtype {section.dtype} conflicts with tp_model_init dtype {req['dtype']}")
    return merged, req["dtype"], req["tp_group"]


def _linear_view(mod: nn.Module) -> nn.Module:
    """The module as an ``nn.Linear``-shaped holder of the same Parameters (Conv1D: weight transposed in place)."""
    if not is_conv1d(mod):
        return mod
    holder = nn.Module()
    mod.weight.data = mod.weight.data.t().contiguous()
    holder.weight = mod.weight
    holder.bias = getattr(mod, "bias", None)
    return holder


def _make_layer(mod: nn.Module, name: str, place: Placement, group: Any, meta: Any, overlap: bool,
                sp: bool) -> nn.Module:
    """The tensor-parallel layer for one placement (packed weights: each sub-matrix split on its own);
    ``sp``: sequence parallel inside the repeated blocks."""
    from .column import LinearLayer
    from .fused import SubParamLinearAllreduce, SubParamLinearLayer
    from .layer import HasParallelTwin
    from .row import LinearAllreduce

    sp = sp and place.block is not None
    row_cls: Any = LinearAllreduce
    col_cls: Any = LinearLayer
    if isinstance(mod, HasParallelTwin):  # e.g. compression-aware linears (compression/tensor_parallel.py)
        twin = mod.tensor_parallel_twin("row" if place.kind == PartitionType.ROW else "column", place.shape is not None)
        row_cls = col_cls = twin or (row_cls if place.kind == PartitionType.ROW else col_cls)
    if place.kind == PartitionType.ROW:
        if place.shape is not None:
            dim = 1 if place.partition_dim is None else place.partition_dim
            return SubParamLinearAllreduce(mod, group, shape=place.shape, partition_dim=dim, name=name, tp_meta=meta,
                                           sequence_parallel=sp)
        return row_cls(mod, group, name=name, tp_meta=meta, sequence_parallel=sp)
    if place.shape is None:
        return col_cls(mod, group, gather_output=place.gather_output, name=name, tp_meta=meta,
                           overlap_comm=overlap, sequence_parallel=sp)
    if place.gather_output:
        raise ValueError(f"AutoTP layer {name}: gather_output with a shaped (packed) spec is not supported yet (as "
                         "in DeepSpeed)")
    dim = 0 if place.partition_dim is None else place.partition_dim
    return SubParamLinearLayer(mod, group, shape=place.shape, partition_dim=dim, name=name, tp_meta=meta,
                               overlap_comm=overlap, sequence_parallel=sp)


def _local_heads(model: nn.Module, parents: dict[str, list[str]]) -> None:
    """Attention bookkeeping kept in attributes (GPT-2): the local q width and head count."""
    for pname, children in parents.items():
        parent = model.get_submodule(pname)
        if not hasattr(parent, "split_size"):
            continue
        fused = [c for c in children if len(getattr(getattr(parent, c), "subparam_sizes", ())) == 3]
        if not fused:
            continue
        local_q = getattr(parent, fused[0]).local_subparam_sizes()[0]
        parent.split_size = local_q
        if hasattr(parent, "head_dim") and hasattr(parent, "num_heads"):
            parent.num_heads = local_q // parent.head_dim


@torch.no_grad()
def _sync_over(model: nn.Module, group: Any) -> None:
    """Every rank of the group starts from the group's first rank's full weights and RNG state."""
    if comm.get_world_size(group) == 1:
        return
    src = comm.global_rank_of(group, 0)
    for t in [*model.parameters(), *model.buffers()]:
        comm.broadcast(t.data, src=src, group=group)
    rng = torch.get_rng_state()
    comm.broadcast(rng, src=src, group=group)
    torch.set_rng_state(rng)


def autotp_shard(model: nn.Module, tp_group: Any, section: TensorParallelConfig | None = None,
                 dtype: torch.dtype | None = None) -> TensorParallelModel:
    """Split ``model`` in place over ``tp_group`` (every rank calls it); returns what was split."""
    from .layer import tp_shard_specs
    from .shard import AutoTPMeta

    section = section if section is not None else TensorParallelConfig()
    if getattr(model, STATE_ATTR, None) is not None:
        raise ValueError("autotp_shard: this model is already split for tensor parallelism")
    size, rank = comm.get_world_size(tp_group), comm.get_rank(tp_group)
    if section.size > 1 and section.size != size:
        raise ValueError(f"tensor_parallel size {section.size} but the tensor-parallel group has {size} ranks")
    if section.vocab_parallel_lm_head:
        raise ValueError("tensor_parallel.vocab_parallel_lm_head: true is not supported yet by AutoTP in zerospeed")
    if dtype is not None:
        model.to(dtype=dtype)
    config = resolve_partition_config(section.preset_model, section.partition_config, size) or plan_config(model, size)
    plan = plan_model(model, config)
    if size == 1:  # the rules are checked; nothing to split (the model keeps its own layers and layouts)
        state = TensorParallelModel(tp_group, 1, 0, plan)
        setattr(model, STATE_ATTR, state)
        return state
    _sync_over(model, tp_group)
    meta = AutoTPMeta.from_model_config(getattr(model, "config", None), section.tp.tp_grain_size)
    state = TensorParallelModel(tp_group, size, rank, plan)
    parents: dict[str, list[str]] = {}
    error = ""
    try:
        for name, place in plan.items():
            if place.kind == PartitionType.SKIP:
                continue
            pname, _, leaf = name.rpartition(".")
            parent = model.get_submodule(pname) if pname else model
            mod = getattr(parent, leaf)
            if is_conv1d(mod):
                state.transposed.add(f"{name}.weight")
            setattr(parent, leaf, _make_layer(_linear_view(mod), name, place, tp_group, meta, section.tp_overlap_comm,
                                              section.sequence_parallel and size > 1))
            parents.setdefault(pname, []).append(leaf)
    except ValueError as exc:  # e.g. heads that do not split: only some ranks see it, every rank must raise
        error = str(exc)
    errors = [e for e in comm.all_gather_object(error, group=tp_group) if e] if size > 1 else [error] * bool(error)
    if errors:
        raise ValueError(f"AutoTP could not split the model over {size} ranks: {errors[0]}")
    _local_heads(model, parents)
    state.specs = tp_shard_specs(model)
    _grad_allreduce_hooks(model, config, tp_group)
    if section.sequence_parallel and size > 1:
        state.sequence_parallel = _sequence_region(model, state, tp_group)
    setattr(model, STATE_ATTR, state)
    return state


def _first(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, (tuple, list)) else x


def _with_first(x: Any, t: torch.Tensor) -> Any:
    return (t, *x[1:]) if isinstance(x, tuple) else [t, *x[1:]] if isinstance(x, list) else t


def _sequence_region(model: nn.Module, state: TensorParallelModel, group: Any) -> Any:
    """Megatron sequence parallelism over the repeated blocks: the first block's input is cut to this rank's
    tokens, the last block's output gathered back; the blocks' replicated parameters (norms) sum their
    gradients over the group. Dimension 1 is the sequence (``[batch, seq, hidden]``)."""
    from .mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
    from .policy import block_names, model_type_of
    from .sequence import SequenceParallelGradSync

    mtype = model_type_of(model)
    if mtype not in _SP_MODEL_TYPES:
        raise ValueError(f"tensor_parallel.sequence_parallel with a '{mtype}' model is not supported yet by zerospeed; "
                         f"supported: zerospeed's GPT, models without config.model_type, and {_SP_MODEL_TYPES[1:]}")
    blocks = block_names(model)
    if not blocks:
        raise ValueError("tensor_parallel.sequence_parallel: the model has no repeated blocks (nn.ModuleList)")
    first, last = model.get_submodule(blocks[0]), model.get_submodule(blocks[-1])

    def enter(_m: nn.Module, args: tuple, kwargs: dict) -> Any:
        if args:
            return (scatter_to_sequence_parallel_region(args[0], group), *args[1:]), kwargs
        key = next(iter(kwargs))  # hidden_states passed by name
        return args, {**kwargs, key: scatter_to_sequence_parallel_region(kwargs[key], group)}

    def leave(_m: nn.Module, _args: tuple, out: Any) -> Any:
        return _with_first(out, gather_from_sequence_parallel_region(_first(out), group,
                                                                     tensor_parallel_output_grad=False))

    first.register_forward_pre_hook(enter, with_kwargs=True)
    last.register_forward_hook(leave)
    if mtype not in (None, "gpt2"):
        _gather_at_attention(model, blocks, group)
    split_ids = state.split_params(model)
    tp_layer_params = {id(p) for n, p in model.named_parameters() if n in state.specs}
    replicated = [p for b in blocks for p in model.get_submodule(b).parameters()
                  if id(p) not in split_ids and id(p) not in tp_layer_params]
    return SequenceParallelGradSync(replicated, group)


def _gather_at_attention(model: nn.Module, blocks: list[str], group: Any) -> None:
    """Llama-style attention reads ``(batch, seq)`` from its input, so it gets the whole sequence: gathered at
    entry (backward keeps this rank's slice), its q/k/v column layers then run as plain tensor-parallel
    layers (their input-gradient all-reduce sums the partial gradients; all-reduce then slice is the
    reduce-scatter Megatron does). The output projection still reduce-scatters back to ``seq/tp`` tokens."""
    from .column import LinearLayer
    from .mappings import gather_from_sequence_parallel_region

    def gather(_m: nn.Module, args: tuple, kwargs: dict) -> Any:
        if args:
            return (gather_from_sequence_parallel_region(args[0], group, tensor_parallel_output_grad=False),
                    *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
        return args, {**kwargs, key: gather_from_sequence_parallel_region(kwargs[key], group,
                                                                          tensor_parallel_output_grad=False)}

    for b in blocks:
        block = model.get_submodule(b)
        for name in _SHAPE_READING_ATTENTION:
            attn = getattr(block, name, None)
            if attn is None:
                continue
            for child in attn.modules():
                if isinstance(child, LinearLayer):
                    child.sequence_parallel = False
            attn.register_forward_pre_hook(gather, with_kwargs=True)


def _grad_allreduce_hooks(model: nn.Module, config: Any, group: Any) -> None:
    """``skip`` specs with ``grad_allreduce``: a replicated parameter fed by split activations sums its gradient."""
    if config is None or comm.get_world_size(group) == 1:
        return
    from .policy import model_type_of

    mtype = model_type_of(model)
    for name, p in model.named_parameters():
        spec = config.find_matching_spec(name, mtype)
        if spec is not None and spec.grad_allreduce:
            def hook(g: torch.Tensor) -> torch.Tensor:
                g = g.contiguous()
                comm.all_reduce(g, group=group)
                return g
            p.register_hook(hook)


def tp_state(model: nn.Module) -> TensorParallelModel | None:
    return getattr(model, STATE_ATTR, None)
