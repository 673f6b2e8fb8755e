"""PyTorch Lightning through zerospeed: ``Trainer(strategy="zerospeed_stage_3")`` after
``import zerospeed.integrations.lightning`` (which registers the strategy names), or
``Trainer(strategy=ZeroSpeedStrategy(stage=2, ...))``; Fabric likewise (``Fabric(strategy="zerospeed_stage_2")``). Needs ``lightning`` (an optional extra)."""

from __future__ import annotations

try:
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry
except ImportError as exc:  # pragma: no cover - the optional dependency is missing
    raise ImportError("zerospeed.integrations.lightning needs PyTorch Lightning: pip install lightning") from exc

from .fabric import ZeroSpeedFabricPrecision, ZeroSpeedFabricStrategy
from .precision import ZeroSpeedPrecision
from .strategy import ZeroSpeedStrategy

if "zerospeed" not in StrategyRegistry:
    ZeroSpeedStrategy.register_strategies(StrategyRegistry)
if "zerospeed" not in FABRIC_REGISTRY:
    ZeroSpeedFabricStrategy.register_strategies(FABRIC_REGISTRY)

__all__ = ["ZeroSpeedFabricPrecision", "ZeroSpeedFabricStrategy", "ZeroSpeedPrecision", "ZeroSpeedStrategy"]
