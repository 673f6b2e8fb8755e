"""The ``compile`` section: DeepSpeed's keys and defaults for ``engine.compile()``.

In DeepSpeed every key of this section belongs to DeepCompile (``deepcompile: true``): its own graph passes
that schedule ZeRO's gathers, releases, reductions and offloads inside the compiled graph. Without
``deepcompile`` DeepSpeed reads none of them and ``engine.compile()`` is plain ``torch.compile`` of the model.
zerospeed implements that plain compile (``runtime/compile.py``) under every stage; DeepCompile is not built,
so every key here is listed in ``unsupported.py`` (``DEEPCOMPILE_KEYS``): at its default it is accepted and
changes nothing, as in DeepSpeed; any other value raises ``NotSupportedYetError`` naming the key.
"""

from __future__ import annotations

from typing import Literal

from .base import Section

PassName = Literal["z1", "z3", "autosp", "autotp"]


class CompileConfig(Section):
    deepcompile: bool = False
    """DeepCompile (ZeRO passes inside the compiled graph): not supported yet."""
    autoep_non_moe: bool = False
    """Compile the parents of AutoEP layers only (regional compile): not supported yet."""
    free_activation: bool = False
    free_activation_threshold: int = 10 * 1024 * 1024
    offload_activation: bool = False
    offload_activation_pin_memory: bool = True
    offload_opt_states: bool = False
    double_buffer: bool = True
    symmetric_memory: bool = False
    debug_log: bool = False
    offload_parameters: bool = False
    sync_before_reduce: bool = False
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    sync_after_allgather: bool = False
    keep_int_input_tensors: bool = True
    keep_all_input_tensors: bool = False
    passes: list[PassName] | None = None
    """DeepCompile's pass list: only ``null`` (no DeepCompile pass) is supported."""
