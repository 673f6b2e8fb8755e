"""``EngineParts``: everything ``initialize()`` built for one engine, handed to ``Engine`` in one value.

The engine never finds a part by probing attributes that a builder set after construction: what it holds
is what this value held. ``None`` means the feature is off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..comm.logger import CommsLogger
from ..zero import ZeroOptimizer


def _background_writer() -> Any:
    from .checkpoint.async_save import BackgroundWriter

    return BackgroundWriter()


@dataclass(frozen=True)
class EngineParts:
    optimizer: ZeroOptimizer | None = None
    lr_scheduler: Any = None
    training_dataloader: Any = None
    zero3: Any = None  # the ZeRO-3 runtime (zero.stage3.Stage3Runtime) when stage 3 is on
    data_efficiency: Any = None  # curriculum / PLD / random-LTD (data_pipeline.runtime.DataEfficiency)
    tensor_parallel: Any = None  # AutoTP training (parallel/tensor/training.py)
    sequence_grid: Any = None  # the (data, sequence) grid under sequence parallelism
    fp8_modules: list[str] = field(default_factory=list)  # names of the linears computing in FP8
    heap_trimmer: Any = None  # host engines: glibc's freed heap given back in backward (accelerator/host_malloc.py)
    comms: CommsLogger = field(default_factory=CommsLogger)  # this engine's collectives (comm/logger.py)
    plan: Any = None  # the TrainPlan (runtime/plan.py)
    checkpoint_group: Any = None  # who writes checkpoint files (None: the data-parallel group)
    mp_world_size: int = 1  # tensor-parallel ways (DeepSpeed's engine.mp_world_size)
    model_export: Any = None  # how save_16bit_model collects the whole model (runtime/export_model.py)
    autocast: Any = None  # torch_autocast: the forward's autocast region (precision/autocast.py)
    hybrid: Any = None  # hybrid_engine: rollout phases for engine.generate() (runtime/hybrid_engine.py)
    checkpoint_writer: Any = field(default_factory=_background_writer)  # async saves (runtime/checkpoint/)
    activation_checkpointing: Any = None  # checkpointing.ActivationCheckpointing (None: the process default's)
    checkpoint_parts: tuple[Any, ...] = ()  # what each part keeps in a checkpoint (runtime/build_checkpoint.py)
    compression: Any = None  # compression_training / MoQ schedule (compression/runtime.py:CompressionRuntime)
