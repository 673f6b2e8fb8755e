"""The ``compile`` section: DeepSpeed's keys and defaults for ``engine.compile()``.

In DeepSpeed every key of this section belongs to DeepCompile (``deepcompile: true``): its own graph passes
that schedule ZeRO's gathers, releases, reductions and offloads inside the compiled graph. Without
``deepcompile`` DeepSpeed reads none of them and ``engine.compile()`` is plain ``torch.compile`` of the model.
zerospeed implements that plain compile (``runtime/compile.py``) under every stage; DeepCompile is not built,
so ``deepcompile: true`` and every DeepCompile key set away from its default raise ``NotSupportedYetError``
naming the key instead of being ignored. At their defaults the keys change nothing, as in DeepSpeed.
"""

from __future__ import annotations

from typing import Literal

from .base import Section
from .errors import NotSupportedYetError

PassName = Literal["z1", "z3", "autosp", "autotp"]


class CompileConfig(Section):
    deepcompile: bool = False
    """DeepCompile (ZeRO passes inside the compiled graph): not supported yet."""
    autoep_non_moe: bool = False
    """Compile the parents of AutoEP layers only: not supported yet (zerospeed has no AutoEP)."""
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

    def refuse_unsupported(self) -> None:
        """Raise ``NotSupportedYetError`` for the first DeepCompile key set away from its default."""
        values = {
            "deepcompile": self.deepcompile, "autoep_non_moe": self.autoep_non_moe,
            "free_activation": self.free_activation, "free_activation_threshold": self.free_activation_threshold,
            "offload_activation": self.offload_activation,
            "offload_activation_pin_memory": self.offload_activation_pin_memory,
            "offload_opt_states": self.offload_opt_states, "double_buffer": self.double_buffer,
            "symmetric_memory": self.symmetric_memory, "debug_log": self.debug_log,
            "offload_parameters": self.offload_parameters, "sync_before_reduce": self.sync_before_reduce,
            "sync_after_reduce": self.sync_after_reduce, "sync_before_allgather": self.sync_before_allgather,
            "sync_after_allgather": self.sync_after_allgather, "keep_int_input_tensors": self.keep_int_input_tensors,
            "keep_all_input_tensors": self.keep_all_input_tensors, "passes": self.passes,
        }
        for key, value in values.items():
            default = type(self).model_fields[key].default
            if value != default:
                what = "DeepCompile" if key == "deepcompile" else f"DeepCompile's {key}"
                raise NotSupportedYetError(
                    f"compile.{key}", f"{what} is not supported yet by zerospeed (value {value!r}; default "
                    f"{default!r}). engine.compile() is plain torch.compile of the model under every ZeRO stage; "
                    "remove the key or set it to its default")
