"""The ``compile`` section: DeepSpeed's keys and defaults for ``engine.compile()``.

In DeepSpeed every key of this section belongs to DeepCompile (``deepcompile: true``): its own graph passes
that schedule ZeRO's gathers, releases, reductions and offloads inside the compiled graph. Without
``deepcompile`` DeepSpeed reads none of them and ``engine.compile()`` is plain ``torch.compile`` of the model
(``runtime/compile.py``). With it, ``engine.compile()`` runs ``runtime/deepcompile.py``: ``passes``, ``debug_log``,
``free_activation(_threshold)``, the four ``sync_*`` keys and the three offload passes (``offload_opt_states``,
``offload_parameters``: ``runtime/deepcompile_offload.py``; ``offload_activation(_pin_memory)``:
``zero/stage3/graph_offload.py``) are read there, their combinations checked in ``runtime/plan.py``;
``double_buffer`` and ``keep_*_input_tensors`` are accepted hints (``hints.py``); ``symmetric_memory`` is read by
``runtime/deepcompile.symmetric_gathers`` (CUDA symmetric memory, ``comm/symmetric.py``; refused on CPU/Gloo with
the reason when ``engine.compile()`` runs). ``autoep_non_moe`` is not a DeepCompile key: it
is plain ``torch.compile`` of the parents of AutoEP's MoE blocks (``runtime/compile.py``). Set without ``deepcompile``, a key that DeepCompile reads
draws a warning (it has no effect, as in DeepSpeed).
"""

from __future__ import annotations

import warnings
from typing import Literal

from pydantic import Field, model_validator

from .base import Section

PassName = Literal["z1", "z3", "autosp", "autotp"]


class CompileConfig(Section):
    deepcompile: bool = False
    """DeepCompile: ``engine.compile()`` puts ZeRO's gathers and reductions inside the compiled graph."""
    autoep_non_moe: bool = False
    """AutoEP regional compile (plain ``torch.compile``, not DeepCompile): each AutoEP MoE block stays eager and the
    module calling it compiles (``runtime/compile.compile_autoep_regions``)."""
    free_activation: bool = False
    """Free each saved activation of at least ``free_activation_threshold`` bytes right after its last use in the
    compiled backward (``aot_eager``; inductor frees its buffers itself)."""
    free_activation_threshold: int = Field(10 * 1024 * 1024, ge=0)
    """Bytes (as DeepSpeed's documentation says; its code compares elements)."""
    offload_activation: bool = False
    """ZeRO-3, ``aot_eager``: the saved activations a compile-time plan picks (largest kept while they fit in the
    device's memory budget, the rest of those of >= 5 MiB) live in host memory from forward to backward."""
    offload_activation_pin_memory: bool = True
    """Pin the host copies of offloaded activations (CUDA only; no pinning on a CPU-only machine)."""
    offload_opt_states: bool = False
    """ZeRO-3: the optimizer's state tensors go to host memory at the head of each training forward and come back
    just before the optimizer step."""
    double_buffer: bool = True
    symmetric_memory: bool = False
    """ZeRO-3 on CUDA: the graph's parameter all-gathers read each peer's shard from a symmetric-memory workspace
    (``comm/symmetric.py``) instead of running NCCL's all-gather; refused where the data-parallel group has no
    symmetric memory (CPU/Gloo)."""
    debug_log: bool = False
    """Log each graph after the passes, and record every graph op call (``engine.deepcompiled.graph.log``)."""
    offload_parameters: bool = False
    """ZeRO-3: the parameter shards live in a host home (zerospeed's parameter offload); the graph's gathers read
    them from there."""
    sync_before_reduce: bool = False
    """Synchronise the accelerator before each gradient hand-off to the reducer (a no-op on CPU)."""
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    """Synchronise the accelerator before each parameter all-gather in the graph (a no-op on CPU)."""
    sync_after_allgather: bool = False
    keep_int_input_tensors: bool = True
    keep_all_input_tensors: bool = False
    passes: list[PassName] | None = None
    """DeepSpeed's parallelisation pass: ``["z3"]`` at stage 3, ``["z1"]`` at stages 1-2 (the default, ``null``,
    picks it from the stage); ``autosp`` and ``autotp`` are not supported yet."""

    @model_validator(mode="after")
    def _warn_without_deepcompile(self) -> CompileConfig:
        if not self.deepcompile:
            read = [k for k in ("debug_log", "free_activation", "sync_before_reduce", "sync_after_reduce", "sync_before_allgather",
                                "sync_after_allgather", "offload_opt_states", "offload_parameters",
                                "offload_activation", "symmetric_memory") if getattr(self, k)] + (["passes"] if self.passes else [])
            if read:
                warnings.warn(f"compile.{read[0]} has no effect without compile.deepcompile: true (as in DeepSpeed)",
                              stacklevel=2)
        return self
