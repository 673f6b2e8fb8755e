"""ZenFlow (``zero_optimization.zenflow``): top-k gradient columns stepped on the device every step, the
rest accumulated and applied by the host's Adam every ``update_interval`` steps (optionally overlapped).

``select`` (which elements are important, pure), ``schedule`` (when to select and update, pure),
``stepper`` (the step), ``state`` (its checkpoint entries).
"""

from .stepper import ZenFlowStepper

__all__ = ["ZenFlowStepper"]
