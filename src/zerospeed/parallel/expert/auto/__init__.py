"""AutoEP: expert parallelism for Hugging Face MoE models from the ``expert_parallel`` config section alone.

``autoep_model(section, model)`` finds the MoE blocks (``detect.py``) and swaps each block's experts module
for ``AutoEPExperts`` (``layer.py``: grouped weights, one grouped matmul per rank, tokens moved with the
MoE all-to-all; the routing keys adjust the HF router's weights: ``routing.py``). The engine then treats those like DeepSpeed MoE layers (``parallel/expert/training.py``):
expert groups, expert-data-parallel gradient reduction, ZeRO partitions over the expert-data group.
"""

from __future__ import annotations

from torch import nn

from ....config.errors import ConfigError
from ....config.expert_parallel import ExpertParallelConfig
from .detect import MoEBlockSpec, find_moe_blocks
from .layer import AutoEPExperts, ExpertSlice, expert_slice
from .routing import RouteAdjust, route_adjust


def autoep_model(section: ExpertParallelConfig, model: nn.Module) -> list[MoEBlockSpec]:
    """Replace the experts of every detected MoE block in place (nothing when the section is off)."""
    if not section.enabled:
        return []
    specs = find_moe_blocks(model, section)
    if not specs:
        raise ConfigError("expert_parallel", "enabled, but no MoE block was found (a module with a router "
                          "'weight' [E, H] and experts holding 3-D weights [E, 2I, H] / [E, H, I]); set "
                          "moe_layer_pattern, router_pattern, expert_pattern and expert_w1/expert_w2/expert_w3")
    for spec in specs:
        if spec.num_experts % section.autoep_size:
            raise ValueError(f"expert_parallel.autoep_size {section.autoep_size} does not divide the "
                             f"{spec.num_experts} experts of {spec.name!r}; valid sizes: "
                             f"{[d for d in range(1, spec.num_experts + 1) if spec.num_experts % d == 0]}")
    adjust = route_adjust(section, model, specs)
    for spec in specs:
        block = model.get_submodule(spec.name)
        experts = getattr(block, spec.experts)
        if not isinstance(experts, AutoEPExperts):
            setattr(block, spec.experts, AutoEPExperts(experts, spec, section.autoep_size, section.use_grouped_mm,
                                                       adjust, section.validate_folding_routing))
    return specs


__all__ = ["AutoEPExperts", "ExpertSlice", "MoEBlockSpec", "RouteAdjust", "autoep_model", "expert_slice", "find_moe_blocks"]
