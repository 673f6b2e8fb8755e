"""DeepSpeed's import paths, served under ``zerospeed`` from this one table.

``from zerospeed.pipe import PipelineModule`` works like ``from deepspeed.pipe import PipelineModule``: each
alias below is a thin module, made on first import, that re-exports the public names of the module where
the code really lives (the layout in DESIGN.md). Add a line here to expose a new DeepSpeed path; nothing
else in the tree should re-export for compatibility. Importing this file does not import torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

# DeepSpeed path (with deepspeed -> zerospeed)   ->  where the code lives
# (a tuple of targets: the alias re-exports the public names of each, in order)
ALIASES: dict[str, str | tuple[str, ...]] = {
    "zerospeed.pipe": "zerospeed.parallel.pipeline",
    "zerospeed.runtime.pipe": "zerospeed.parallel.pipeline",
    "zerospeed.runtime.pipe.module": "zerospeed.parallel.pipeline.module",
    "zerospeed.runtime.pipe.engine": "zerospeed.runtime.pipeline_engine",
    "zerospeed.parallel.pipeline.engine": "zerospeed.runtime.pipeline_engine",  # the facade's old home
    "zerospeed.runtime.pipe.topology": "zerospeed.parallel.topology",
    "zerospeed.runtime.pipe.schedule": "zerospeed.parallel.pipeline.schedule",
    "zerospeed.runtime.utils": "zerospeed.parallel.pipeline.partition",
    "zerospeed.utils": ("zerospeed.data.repeating", "zerospeed.runtime.log", "zerospeed.zero.fragments",
                        "zerospeed.zero.stage3.leaves"),
    "zerospeed.utils.z3_leaf_module": "zerospeed.zero.stage3.leaves",
    "zerospeed.utils.logging": "zerospeed.runtime.log",
    "zerospeed.utils.tensor_fragment": "zerospeed.zero.fragments",
    "zerospeed.runtime.lr_schedules": ("zerospeed.optim.schedules", "zerospeed.compat.lr_schedule_names"),
    "zerospeed.runtime.zero": "zerospeed.zero",
    "zerospeed.runtime.compiler": "zerospeed.runtime.compile",
    "zerospeed.runtime.zero.stage_1_and_2": "zerospeed.zero.estimate",
    "zerospeed.runtime.zero.stage3": "zerospeed.zero.estimate",
    "zerospeed.ops": ("zerospeed.optim.named", "zerospeed.compat.ops"),
    "zerospeed.ops.adam": "zerospeed.optim.named",
    "zerospeed.ops.adagrad": "zerospeed.optim.named",
    "zerospeed.ops.lamb": "zerospeed.optim.named",
    "zerospeed.runtime.zero.muon": "zerospeed.optim.muon",
    "zerospeed.runtime.zero.muon.original_muon": "zerospeed.optim.muon",
    "zerospeed.runtime.zero.muon.muon_optimizer": "zerospeed.optim.muon",
    "zerospeed.ops.sparse_attention": "zerospeed.sparse_attention",
    "zerospeed.ops.sparse_attention.sparsity_config": "zerospeed.sparse_attention.layouts",
    "zerospeed.ops.sparse_attention.sparse_self_attention": "zerospeed.sparse_attention.modules",
    "zerospeed.ops.sparse_attention.bert_sparse_self_attention": "zerospeed.sparse_attention.modules",
    "zerospeed.ops.sparse_attention.sparse_attention_utils": "zerospeed.sparse_attention.utils",
    "zerospeed.moe": "zerospeed.parallel.expert",
    "zerospeed.moe.layer": "zerospeed.parallel.expert.layer",
    "zerospeed.moe.sharded_moe": "zerospeed.parallel.expert",
    "zerospeed.moe.experts": "zerospeed.parallel.expert.experts",
    "zerospeed.moe.utils": "zerospeed.parallel.expert.utils",
    "zerospeed.elasticity.config": "zerospeed.config.elasticity",
    "zerospeed.runtime.fp16": "zerospeed.optim.onebit",
    "zerospeed.runtime.fp16.onebit": "zerospeed.optim.onebit",
    "zerospeed.runtime.fp16.onebit.adam": "zerospeed.optim.onebit.adam",
    "zerospeed.runtime.fp16.onebit.zoadam": "zerospeed.optim.onebit.zoadam",
    "zerospeed.runtime.fp16.onebit.lamb": "zerospeed.optim.onebit.lamb",
    "zerospeed.module_inject": "zerospeed.parallel.tensor",
    "zerospeed.module_inject.layers": "zerospeed.parallel.tensor",
    "zerospeed.module_inject.tp_shard": "zerospeed.parallel.tensor.shard",
    "zerospeed.sequence": "zerospeed.parallel.sequence",
    "zerospeed.sequence.layer": "zerospeed.parallel.sequence.layer",
    "zerospeed.runtime.sequence_parallel": "zerospeed.parallel.sequence",
    "zerospeed.runtime.sequence_parallel.ulysses_sp": "zerospeed.parallel.sequence.ulysses_sp",
    "zerospeed.runtime.data_pipeline": "zerospeed.data_pipeline",
    "zerospeed.runtime.data_pipeline.curriculum_scheduler": "zerospeed.data_pipeline.curriculum_scheduler",
    "zerospeed.runtime.data_pipeline.data_sampling": "zerospeed.data_pipeline.sampler",
    "zerospeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr": (
        "zerospeed.data_pipeline.variable_batch", "zerospeed.data_pipeline.variable_lr",
        "zerospeed.data_pipeline.dynamic_batching"),
    "zerospeed.runtime.data_pipeline.data_routing": "zerospeed.data_pipeline.random_ltd",
    "zerospeed.runtime.data_pipeline.data_routing.basic_layer": "zerospeed.data_pipeline.random_ltd",
    "zerospeed.runtime.data_pipeline.data_routing.helper": "zerospeed.data_pipeline.random_ltd",
    "zerospeed.runtime.data_pipeline.data_routing.scheduler": "zerospeed.data_pipeline.random_ltd_scheduler",
    "zerospeed.runtime.progressive_layer_drop": "zerospeed.data_pipeline.progressive_layer_drop",
    "zerospeed.ops.random_ltd": "zerospeed.data_pipeline.random_ltd",
    "zerospeed.ops.random_ltd.dropping_utils": "zerospeed.data_pipeline.random_ltd",
    # --- issue 29 (conformance with DeepSpeed's own unit tests): adapters under zerospeed/compat/ ---
    "zerospeed.ops.op_builder": "zerospeed.compat.op_builder",
    "zerospeed.utils.torch": "zerospeed.compat.torch_version",
    "zerospeed.runtime.precision_config": "zerospeed.compat.precision_config",
    "zerospeed.runtime.config": "zerospeed.compat.runtime_config",
    "zerospeed.git_version_info": "zerospeed.compat.git_version_info",
    "zerospeed.runtime.zero.partition_parameters": "zerospeed.compat.partition_parameters",
    "zerospeed.utils.numa": "zerospeed.compat.numa",
    # --- issue 35: DeepSpeed 0.19.6's compression library (zerospeed/compression/) ---
    "zerospeed.compression.compress": "zerospeed.compression.apply",
    "zerospeed.compression.basic_layer": "zerospeed.compression.layers",
    "zerospeed.compression.utils": ("zerospeed.compression.quantizers", "zerospeed.compression.masks"),
    "zerospeed.compression.config": "zerospeed.config.compression_training",
    "zerospeed.runtime.zero.config": "zerospeed.compat.zero_config",
    "zerospeed.runtime.zero.offload_config": "zerospeed.compat.zero_config",
    "zerospeed.runtime.config_utils": "zerospeed.compat.config_utils",
    "zerospeed.utils.groups": "zerospeed.compat.groups",
    "zerospeed.utils.zero_to_fp32": "zerospeed.compat.zero_to_fp32",
    "zerospeed.utils.comms_logging": "zerospeed.comm.logger",
    "zerospeed.launcher.runner": "zerospeed.compat.launcher_runner",
    "zerospeed.runtime.fp16.fused_optimizer": "zerospeed.compat.optimizer_names",
    "zerospeed.runtime.fp16.unfused_optimizer": "zerospeed.compat.optimizer_names",
    "zerospeed.runtime.bf16_optimizer": "zerospeed.compat.optimizer_names",
    "zerospeed.runtime.comm": "zerospeed.compat.coalesced_collectives",
    "zerospeed.runtime.comm.coalesced_collectives": "zerospeed.compat.coalesced_collectives",
    "zerospeed.runtime.zero.linear": "zerospeed.compat.zero_linear",
    "zerospeed.runtime.zero.mics": "zerospeed.zero.stage3.mics_init",
    "zerospeed.monitor": "zerospeed.profiling.monitor",
    "zerospeed.monitor.monitor": "zerospeed.profiling.monitor",
    "zerospeed.monitor.tensorboard": "zerospeed.profiling.monitor.tensorboard",
    "zerospeed.monitor.wandb": "zerospeed.profiling.monitor.wandb",
    "zerospeed.monitor.comet": "zerospeed.profiling.monitor.comet",
    "zerospeed.monitor.csv_monitor": "zerospeed.profiling.monitor.csv",
    "zerospeed.monitor.config": "zerospeed.compat.monitor_config",
    "zerospeed.utils.timer": ("zerospeed.profiling.timers", "zerospeed.profiling.throughput"),
    "zerospeed.runtime.tensor_parallel": "zerospeed.parallel.tensor",
    "zerospeed.runtime.tensor_parallel.config": ("zerospeed.config.tensor_parallel",
                                                 "zerospeed.parallel.tensor.hf_tp_plan"),  # _get_hf_tp_plan
}

# --- names DeepSpeed's example scripts reach (issue 29 part B): more targets for an alias above ---
ALIAS_ADDITIONS: dict[str, tuple[str, ...]] = {
    "zerospeed.runtime.utils": ("zerospeed.runtime.seed",  # set_random_seed (the pipeline example)
                                "zerospeed.compat.runtime_utils",  # see_memory_usage
                                "zerospeed.compat.partitioned_tensor",  # PartitionedTensor, prefix_sum_inc
                                "zerospeed.compat.runtime_norms"),  # clip_grad_norm_, CheckOverflow...
    "zerospeed.compression.helper": ("zerospeed.compat.compression_helper",  # DS-Chat LoRA
                                     "zerospeed.compression.replace"),
    "zerospeed.utils": ("zerospeed.compat.on_device",),  # deepspeed.utils.OnDevice
    # DeepSpeed's optimizer-wrapper names, for isinstance checks (nothing is one: compat/optimizer_names.py)
    "zerospeed.runtime.zero.stage_1_and_2": ("zerospeed.compat.optimizer_names",),
    "zerospeed.runtime.zero.stage3": ("zerospeed.compat.optimizer_names",
                                      "zerospeed.zero.stage3.unwrap"),  # unwrap_model_for_generation (TRL)
}
for _path, _extra in ALIAS_ADDITIONS.items():
    _base = ALIASES.get(_path, ())
    ALIASES[_path] = (*((_base,) if isinstance(_base, str) else _base), *_extra)


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str | tuple[str, ...]) -> None:
        self.targets = (target,) if isinstance(target, str) else tuple(target)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a fresh, empty module

    def exec_module(self, module: ModuleType) -> None:
        reals = [importlib.import_module(t) for t in self.targets]
        exported: list[str] = []
        for real in reals:
            names = getattr(real, "__all__", None) or [n for n in vars(real) if not n.startswith("_")]
            for name in names:
                setattr(module, name, getattr(real, name))
                if name not in exported:
                    exported.append(name)
        module.__all__ = exported  # type: ignore[attr-defined]
        module.__doc__ = f"DeepSpeed-path alias of {', '.join(self.targets)} (see zerospeed/_aliases.py)."
        module.__path__ = []  # type: ignore[attr-defined]  # may be the parent of other aliases
        for name in exported:  # a name that is also a submodule (deepspeed.utils.z3_leaf_module): DeepSpeed's package
            if f"{module.__name__}.{name}" in ALIASES:  # imports the submodule, then binds the name over it
                value = getattr(module, name)
                importlib.import_module(f"{module.__name__}.{name}")
                setattr(module, name, value)

        def __getattr__(name: str) -> Any:  # noqa: N807 - module-level attribute fallback
            if f"{module.__name__}.{name}" in ALIASES:  # a DeepSpeed submodule path wins over a target's own import
                return importlib.import_module(f"{module.__name__}.{name}")  # (zerospeed.utils.logging: not stdlib)
            for real in reals:
                if hasattr(real, name):
                    return getattr(real, name)
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

        module.__getattr__ = __getattr__  # type: ignore[attr-defined]


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        real = ALIASES.get(fullname)
        if real is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real), is_package=True)


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
