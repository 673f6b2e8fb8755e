"""ZeRO-Offload and ZeRO-Infinity: the optimizer step and its state on the host or on disk.

``swapper`` moves host buffers to and from files asynchronously; ``cpu_adam`` holds the flat CPU kernels;
``stepper`` is the offloaded step that ``ZeroOptimizer`` runs; ``preflight`` checks an ``nvme_path``;
``param_home`` keeps stage-3 parameter shards on the host or on disk (ZeRO-Infinity ``offload_param``).
"""

from .cpu_adam import ADAGRAD, ADAM, ADAMW, FlatKernel, adam_step_flat, kernel_for
from .param_home import ParamHome
from .preflight import check_nvme_path
from .stepper import OffloadStepper
from .subgroups import move_master_to_host, plan_subgroups
from .swapper import AsyncSwapper, OffloadIOError, aligned_empty

__all__ = ["ADAGRAD", "ADAM", "ADAMW", "AsyncSwapper", "FlatKernel", "OffloadIOError", "OffloadStepper", "ParamHome",
           "adam_step_flat", "aligned_empty", "check_nvme_path", "kernel_for", "move_master_to_host",
           "plan_subgroups"]
