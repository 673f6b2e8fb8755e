"""Mixed precision: dtype policy and loss scaling."""

from .loss_scaler import LossScaleAtMinimumError, LossScaler, NoScaler
from .policy import PrecisionPolicy, make_policy

__all__ = ["LossScaleAtMinimumError", "LossScaler", "NoScaler", "PrecisionPolicy", "make_policy"]
