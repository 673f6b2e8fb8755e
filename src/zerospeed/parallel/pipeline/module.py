"""PipelineModule: a model written as a list of layers, cut into stages; each rank builds only its own.

``layers`` is a sequence of ``nn.Module`` objects, ``LayerSpec`` (a class and its arguments, built only on
the rank that owns the layer, so a stage never materialises another stage's weights), ``TiedLayerSpec``
(several layers sharing one module, e.g. the input embedding reused as the output head) or plain callables.
The forward pass is ``x = layer(x)`` for each layer. Stage boundaries come from ``partition_method``
(``uniform``, ``parameters`` or ``type:<regex>``) with DeepSpeed's algorithm, so the same layers give the
same cut. With ``virtual_stages=v`` the layers are cut into ``stages * v`` parts and rank ``r`` holds parts
``r, r + stages, ...`` (the interleaved schedule's model chunks).

Tied modules held by several stages start from the copy on the lowest rank (broadcast over the tie
group); their gradients are summed over that group before the optimizer step, so the copies stay equal.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from ... import comm
from ...checkpointing import checkpoint as _default_checkpoint
from ..topology import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology
from .partition import partition_balanced, partition_uniform


class PipelineError(Exception):
    """Errors in the use of PipelineModule or the pipeline engine (DeepSpeed's name)."""


class LayerSpec:
    """A layer to build later: ``LayerSpec(nn.Linear, 4, 8, bias=False)`` builds ``nn.Linear(4, 8, bias=False)``."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError("LayerSpec only supports torch.nn.Module types.")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer sharing ``key``'s module with every other TiedLayerSpec of that key.

    ``forward_fn(module, x)`` replaces ``module(x)`` (e.g. the head: ``x @ module.weight.T``);
    ``tied_weight_attr`` names the shared parameters (dotted paths allowed).
    """

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable[..., Any] | None = None,
                 tied_weight_attr: str | list[str] = "weight", **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def _layer_name(layer: Any) -> str | None:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return layer.__class__.__name__
    return getattr(layer, "__name__", None)


def _count_params(layer: Any) -> int:
    """Trainable parameters of one layer; a LayerSpec is built on the meta device (no memory)."""
    if isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"):
                module = layer.build()
        except Exception:  # a constructor that cannot run on meta: build it for real, once
            module = layer.build()
        return sum(p.numel() for p in module.parameters() if p.requires_grad)
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def get_attr_path(module: nn.Module, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def compute_partition(layers: list[Any], num_parts: int, method: str) -> list[int]:
    """Stage boundaries for ``layers`` (pure; DeepSpeed's methods)."""
    method = method.lower()
    if method == "uniform":
        return partition_uniform(len(layers), num_parts)
    if method == "parameters":
        return partition_balanced([_count_params(layer) for layer in layers], num_parts)
    if method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1 if (name := _layer_name(layer)) is not None and pattern.search(name) else 0 for layer in layers]
        if not any(weights):
            raise PipelineError(f"partition_method {method!r}: the regex matches no layer type; layer types are "
                                f"{sorted({n for n in map(_layer_name, layers) if n})}")
        return partition_balanced(weights, num_parts)
    raise NotImplementedError(f"Partitioning method {method} not implemented (use 'uniform', 'parameters' or "
                              "'type:<regex>')")


class PipelineModule(nn.Module):
    def __init__(self, layers: Iterable[Any], num_stages: int | None = None, topology: ProcessTopology | None = None,
                 loss_fn: Callable[..., Any] | None = None, seed_layers: bool = False,
                 seed_fn: Callable[[int], Any] | None = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable[..., Any] = _default_checkpoint,
                 checkpointable_layers: list[str] | None = None, dynamic_shape: bool = False,
                 virtual_stages: int = 1) -> None:
        super().__init__()
        if num_stages is None and topology is None:
            raise RuntimeError("must provide num_stages or topology")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise ValueError("checkpointable_layers must be a list of layer class names")
        if virtual_stages < 1:
            raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
        if not comm.is_initialized():
            comm.init_distributed()
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self.virtual_stages = virtual_stages
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        self._topo = self._topology(num_stages, topology)
        self.num_stages = self._topo.get_dim("pipe")
        self._grid = PipelineParallelGrid(topology=self._topo)
        self.stage_id = self._grid.get_stage_id()
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        self.parts = compute_partition(self._layer_specs, self.num_stages * virtual_stages, partition_method)
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        # chunk c of this rank runs layers chunk_bounds[c] = (start, stop)
        self.chunk_bounds = [(self.parts[c * self.num_stages + self.stage_id],
                              self.parts[c * self.num_stages + self.stage_id + 1]) for c in range(virtual_stages)]
        self.chunk_funcs: list[list[Any]] = [self._build(start, stop) for start, stop in self.chunk_bounds]
        self._local_start, self._local_stop = self.chunk_bounds[0]
        self.forward_funcs = self.chunk_funcs[0] if virtual_stages == 1 else [f for c in self.chunk_funcs for f in c]
        self.tied_comms = self._index_tied_modules()
        self.replicated: set[int] = set()  # ids of tied parameters whose gradient another rank also counts
        for key, info in self.tied_comms.items():
            if self.global_rank != info["ranks"][0]:
                self.replicated.update(id(p) for p in self.tied_modules[key].parameters())
        self._synchronize_tied_weights()

    def _topology(self, num_stages: int | None, topology: ProcessTopology | None) -> ProcessTopology:
        if topology is not None:
            if num_stages is not None and topology.get_dim("pipe") != num_stages:
                raise ValueError(f"num_stages={num_stages} but the topology has {topology.get_dim('pipe')} pipe stages")
            if topology.world_size() != self.world_size:
                raise ValueError(f"the topology holds {topology.world_size()} ranks but the job has {self.world_size}")
            return topology
        assert num_stages is not None
        if num_stages < 1 or self.world_size % num_stages != 0:
            raise RuntimeError(f"num_stages ({num_stages}) must divide distributed world size ({self.world_size})")
        return PipeDataParallelTopology(num_pp=num_stages, num_dp=self.world_size // num_stages)

    # --- building ----------------------------------------------------------------------------------
    def _seed(self, layer_idx: int) -> None:
        if self.seed_fn is not None:
            self.seed_fn(self.base_seed + layer_idx)
        else:
            torch.manual_seed(self.base_seed + layer_idx)

    def _build(self, start: int, stop: int) -> list[Any]:
        funcs: list[Any] = []
        for idx in range(start, stop):
            layer = self._layer_specs[idx]
            if self.seed_layers:
                self._seed(idx)
            if isinstance(layer, PipelineModule):
                raise NotImplementedError("a PipelineModule inside a PipelineModule is not supported")
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
            elif isinstance(layer, (LayerSpec, nn.Module)):
                module = layer.build() if isinstance(layer, LayerSpec) else layer
                self.add_module(str(idx), module)
                funcs.append(module)
            else:
                funcs.append(layer)
        return funcs

    def _index_tied_modules(self) -> dict[str, dict[str, Any]]:
        """One group per tie key and replica (same data / model coordinate) over the stages holding it."""
        tied: dict[str, dict[str, Any]] = {}
        if self.num_stages == 1:
            return tied
        keys = sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)})
        has_model = "model" in self._topo.get_axis_names()
        for key in keys:
            stages = sorted({self.stage_owner(i) for i, s in enumerate(self._layer_specs)
                             if isinstance(s, TiedLayerSpec) and s.key == key})
            for dp in range(self._grid.data_parallel_size):
                for mp in range(self._grid.get_slice_parallel_world_size()):
                    extra = {"data": dp, "model": mp} if has_model else {"data": dp}
                    ranks = [self._grid.stage_to_global(stage_id=s, **extra) for s in stages]
                    group = comm.new_group(ranks)
                    if self.global_rank in ranks:
                        tied[key] = {"ranks": ranks, "group": group, "weight_attr": self.tied_weight_attrs[key],
                                     "module": self.tied_modules[key]}
        return tied

    @torch.no_grad()
    def _synchronize_tied_weights(self) -> None:
        for key, info in self.tied_comms.items():
            for attr in info["weight_attr"]:
                comm.broadcast(get_attr_path(self.tied_modules[key], attr).data, src=min(info["ranks"]),
                               group=info["group"])

    def get_tied_weights_and_groups(self) -> list[tuple[torch.Tensor, Any]]:
        return [(get_attr_path(self.tied_modules[k], a), info["group"]) for k, info in self.tied_comms.items()
                for a in info["weight_attr"]]

    # --- forward -----------------------------------------------------------------------------------
    def _is_checkpointable(self, funcs: list[Any]) -> bool:
        if self.checkpointable_layers is not None:
            return all(f.__class__.__name__ in self.checkpointable_layers for f in funcs)
        return any(len(list(f.parameters())) > 0 for f in funcs if isinstance(f, nn.Module))

    def forward(self, forward_input: Any, chunk: int = 0) -> Any:
        funcs = self.chunk_funcs[chunk]
        start_layer = self.chunk_bounds[chunk][0]

        def run(lo: int, hi: int) -> Callable[..., Any]:
            def exec_range(*inputs: Any) -> Any:
                x = inputs[0] if len(inputs) == 1 else inputs
                for i in range(lo, hi):
                    self.curr_layer = start_layer + i
                    x = funcs[i](x)
                return x
            return exec_range

        interval = self.activation_checkpoint_interval
        if interval <= 0:
            return run(0, len(funcs))(forward_input)
        x = forward_input
        for lo in range(0, len(funcs), interval):
            hi = min(lo + interval, len(funcs))
            args = x if isinstance(x, tuple) else (x,)
            if self._is_checkpointable(funcs[lo:hi]):
                x = self.activation_checkpoint_func(run(lo, hi), *args)
            else:
                x = run(lo, hi)(*args)
        return x

    # --- queries (DeepSpeed's names) ----------------------------------------------------------------
    def partitions(self) -> list[int]:
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        """The pipeline stage (rank along 'pipe') that runs layer ``layer_idx``."""
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer {layer_idx} out of range (the module has {self._num_layers} layers)")
        for part in range(len(self.parts) - 1):
            if self.parts[part] <= layer_idx < self.parts[part + 1]:
                return part % self.num_stages
        raise RuntimeError(f"Layer {layer_idx} not owned? parts={self.parts}")

    def local_layers(self) -> list[int]:
        """Indices of the layers this rank runs (all chunks)."""
        return [i for start, stop in self.chunk_bounds for i in range(start, stop)]

    def layer_module(self, layer_idx: int) -> nn.Module | None:
        """The module holding layer ``layer_idx``'s parameters on this rank (None for a parameter-free callable)."""
        spec = self._layer_specs[layer_idx]
        if isinstance(spec, TiedLayerSpec):
            return self.tied_modules[spec.key] if spec.key in self.tied_modules else None
        return self._modules.get(str(layer_idx))  # type: ignore[return-value]

    def set_checkpoint_interval(self, interval: int) -> None:
        if interval < 0:
            raise ValueError(f"activation checkpoint interval must be >= 0, got {interval}")
        self.activation_checkpoint_interval = interval

    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def get_additional_losses(self) -> dict[str, torch.Tensor] | None:
        return None
