"""Elastic training's batch rules: a global batch size valid at many world sizes (DeepSpeed's
``deepspeed.elasticity``). With ``elasticity.enabled`` the engine takes its batch sizes from here for the
data-parallel size it runs at. Restarting on a world-size change is torchrun's elastic agent's job.
"""

from ..config.elasticity import ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize
from .elasticity import compute_elastic_config, elasticity_enabled, ensure_immutable_elastic_config

__all__ = ["ElasticityConfigError", "ElasticityError", "ElasticityIncompatibleWorldSize", "compute_elastic_config",
           "elasticity_enabled", "ensure_immutable_elastic_config"]
