"""Mixed precision: dtype policy and loss scaling."""

from .autocast import AutocastRegion
from .loss_scaler import GradScalerRule, LossScaleAtMinimumError, LossScaler, NoScaler
from .policy import PrecisionPolicy, make_policy

__all__ = ["AutocastRegion", "GradScalerRule", "LossScaleAtMinimumError", "LossScaler", "NoScaler", "PrecisionPolicy", "make_policy"]
