"""The engine's compression part: the scheduler, MoQ and the eigenvalues, stepped where DeepSpeed 0.19.6 did.

* before the first forward (step 0): the scheduler's step-0 check; MoQ quantizes once if already on;
* in the backward of an accumulation boundary, every ``gas_boundary_resolution`` boundaries, when a bit drop
  is near: the eigenvalues per block, from the micro-batch's loss (DeepSpeed used the accumulated gradients);
* after each optimizer step: MoQ (told whether the step overflowed), then, if the step was applied, the
  scheduler counts it.

``state_dict`` / ``load_state_dict`` carry the schedule's position through a checkpoint (the engine's
``CompressionPart``): the scheduler's step count (the techniques' flags follow from it), MoQ's step count,
mixing ratio and each weight's bits and period (which eigenvalues made per block, so they cannot be replayed
from the step count), the eigenvalue boundary count, and the layer reduction the model was built with (checked
on load). Masks, learned scores and static activation ranges are the module's own buffers and parameters and
travel with it.

``compression_runtime(config, model)`` builds it (None when nothing is on); with ``quantize_training`` it first
makes every layer compression-aware with MoQ on (DeepSpeed quantized all 2-D weights there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import comm
from ..config.compression_training import CompressionTrainingConfig, EigenvalueConfig
from ..config.errors import ConfigError, NotSupportedYetError
from .apply import check_supported, init_compression
from .eigenvalue import Eigenvalue
from .layers import QuantAct, _Compressed
from .moq import MoQ
from .ptq import initialization_quantization, post_init_quantization
from .scheduler import CompressionScheduler


class CompressionRuntime:
    """One engine's compression schedule (module docstring)."""

    def __init__(self, model: nn.Module, cfg: CompressionTrainingConfig, eigen: EigenvalueConfig,
                 dp_group: Any = None) -> None:
        self.model = model
        self.dp_group = dp_group
        for module in model.modules():  # static activation ranges: one range over the data-parallel replicas
            if isinstance(module, QuantAct):
                module.share_ranges(dp_group)
        self.layer_reduction = cfg.layer_reduction.model_dump(mode="json") if cfg.layer_reduction.enabled else None
        self.scheduler = CompressionScheduler(model, cfg)
        wq = cfg.weight_quantization.shared_parameters
        self.moq: MoQ | None = None
        if wq.enabled and not wq.quantize_weight_in_forward:
            self.moq = MoQ(_moq_layers(model, self.scheduler), wq.fp16_mixed_quantize.enabled,
                           wq.fp16_mixed_quantize.quantize_change_ratio, wq.quantize_verbose)
        self.eigenvalue = None
        if eigen.enabled:
            self.eigenvalue = Eigenvalue(eigen.verbose, eigen.max_iter, eigen.tol, eigen.stability,
                                         eigen.gas_boundary_resolution, eigen.layer_name, eigen.layer_num)
        self.block_eigenvalue: dict[int, tuple[float, int]] | None = None
        self._boundaries = 0
        self._started = False

    def before_forward(self) -> None:
        """Step 0's check, once (a loaded checkpoint's state has had it)."""
        if self._started:
            return
        self._started = True
        self.scheduler.step(step_zero_check=True)
        if self.moq is not None and self.scheduler.weight_quantization_enabled:
            self.moq.quantize(False, self.eigenvalue is not None, None)

    def on_backward(self, loss: torch.Tensor, boundary: bool) -> None:
        if self.eigenvalue is None or not boundary or self.moq is None:
            return
        self._boundaries += 1
        if self._boundaries % self.eigenvalue.gas_boundary_resolution == 0 and self.moq.any_precision_switch():
            self.block_eigenvalue = _mean_over(self.eigenvalue.from_loss(loss, self.model), self.dp_group)

    def after_step(self, applied: bool) -> None:
        if self.moq is not None and self.scheduler.weight_quantization_enabled:
            self.moq.quantize(not applied, self.eigenvalue is not None, self.block_eigenvalue)
        self.block_eigenvalue = None
        if applied:
            self.scheduler.step()


    def state_dict(self) -> dict[str, Any]:
        """The schedule's position (module docstring); JSON values only."""
        return {"started": self._started, "scheduler": self.scheduler.state_dict(),
                "moq": None if self.moq is None else self.moq.state_dict(), "eigenvalue_boundaries": self._boundaries,
                "layer_reduction": self.layer_reduction}

    def check_state(self, state: dict[str, Any]) -> str:
        """Why ``state`` cannot be loaded into this runtime ("" when it can)."""
        if state.get("layer_reduction") != self.layer_reduction:
            return (f"it was saved with layer_reduction {state.get('layer_reduction')}, this engine's model was "
                    f"built with {self.layer_reduction}")
        moq = state.get("moq")
        saved = 0 if moq is None else len(moq["layers"])
        here = 0 if self.moq is None else len(self.moq.layers)
        if (moq is None) != (self.moq is None) or saved != here:
            return f"its MoQ schedule has {saved} weights, this engine's {here} (MoQ {'on' if self.moq else 'off'})"
        return ""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s position: the techniques' flags as they were at that step."""
        self._started = bool(state["started"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.moq is not None:
            self.moq.load_state_dict(state["moq"])
        self._boundaries = int(state["eigenvalue_boundaries"])
        self.block_eigenvalue = None


def _mean_over(values: dict[int, tuple[float, int]], group: Any) -> dict[int, tuple[float, int]]:
    """Each block's eigenvalue factor averaged over the data-parallel replicas (each saw its own micro-batch),
    so every replica lengthens the same periods and their weights stay quantized alike (DeepSpeed let each
    rank keep its own)."""
    if group is None or comm.get_world_size(group) == 1 or not values:
        return values
    per_block = {block: value for value, block in values.values()}  # ordered by block index on every rank
    blocks = sorted(per_block)
    mean = torch.tensor([per_block[b] for b in blocks], dtype=torch.float64)
    comm.all_reduce(mean, group=group)
    averaged = dict(zip(blocks, (mean / comm.get_world_size(group)).tolist()))
    return {k: (averaged[block], block) for k, (_, block) in values.items()}


def _moq_layers(model: nn.Module, scheduler: CompressionScheduler) -> list[tuple[nn.Parameter, Any]]:
    names = {n for g in scheduler.groups if g.technique == "weight_quantization" for n in g.all_modules()}
    return [(m.weight, m.weight_quant) for n, m in model.named_modules()
            if n in names and getattr(m, "weight_quant", None) is not None]


def _check_prepared(model: nn.Module, scheduler: CompressionScheduler) -> None:
    for group in scheduler.groups:
        for name in group.all_modules():
            module = model.get_submodule(name)
            if not isinstance(module, _Compressed):
                raise ConfigError(f"compression_training.{group.technique}", f"module '{name}' is a plain "
                                  f"{type(module).__name__}: call zerospeed.compression.init_compression(model, "
                                  "ds_config) before initialize() (as with DeepSpeed)")


def compression_runtime(config: Any, model: nn.Module, dp_group: Any = None) -> CompressionRuntime | None:
    """The engine's compression part for ``config`` (a ZeroSpeedConfig), or None when nothing is on. Before
    that, ``weight_quantization.post_init_quant`` quantizes the matched linears and ``quantized_initialization``
    every linear and embedding not built quantized by ``zero.Init`` (``ptq.py``). ``dp_group``:
    the data-parallel group static activation ranges are taken over."""
    if config.weight_quantization is not None:
        post_init_quantization(model, config.weight_quantization)
        spec = config.weight_quantization.initialization_spec()
        if spec is not None and config.tensor_parallel.size > 1:
            raise NotSupportedYetError("weight_quantization.quantized_initialization", "quantized initialization "
                                       "with tensor parallelism (AutoTP) is not supported yet by zerospeed")
        if spec is not None:
            initialization_quantization(model, spec)
    cfg: CompressionTrainingConfig = config.compression_training
    qt = config.quantize_training
    if qt.eigenvalue.enabled and config.eigenvalue.enabled:
        raise ConfigError("eigenvalue", "given twice: at the top level and in quantize_training; keep one")
    eigen = qt.eigenvalue if qt.eigenvalue.enabled else config.eigenvalue
    if qt.enabled:
        if cfg.weight_quantization.shared_parameters.enabled:
            raise ConfigError("quantize_training", "MoQ is configured twice: quantize_training and "
                              "compression_training.weight_quantization; keep one")
        moq = qt.as_weight_quantization()
        cfg = cfg.model_copy(update={"weight_quantization": moq})
        init_compression(model, {"compression_training": {"weight_quantization": moq.model_dump()}})
    if not cfg.any_enabled and not eigen.enabled:
        return None
    check_supported(cfg)
    if eigen.enabled and (cfg.weight_quantization.shared_parameters.quantize_weight_in_forward
                          or not cfg.weight_quantization.shared_parameters.enabled):
        raise ConfigError("eigenvalue", "eigenvalues steer MoQ's periods: enable quantize_training (or "
                          "compression_training.weight_quantization with quantize_weight_in_forward false)")
    runtime = CompressionRuntime(model, cfg, eigen, dp_group)
    _check_prepared(model, runtime.scheduler)
    return runtime
