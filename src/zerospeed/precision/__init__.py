"""Mixed precision: dtype policy and loss scaling."""

from .loss_scaler import LossScaler, NoScaler
from .policy import PrecisionPolicy, make_policy

__all__ = ["LossScaler", "NoScaler", "PrecisionPolicy", "make_policy"]
