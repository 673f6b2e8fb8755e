"""``graph_harvesting``: DeepSpeed's CUDA-graph capture of its bf16 optimizer's gradient norm and copies.

CUDA graphs exist on CUDA devices only, so on any other device the key is refused by name (with the device
the engine runs on) instead of being ignored. On CUDA the capture is not built yet: refused as "not
supported yet" (the values would be the same; only launch overhead differs).
"""

from __future__ import annotations

import torch

from ..config.errors import ConfigError, NotSupportedYetError

KEY = "graph_harvesting"


def check_graph_harvesting(enabled: bool, device: torch.device) -> None:
    """Raise for ``graph_harvesting: true``: ConfigError off CUDA (naming ``device``), else not supported yet."""
    if not enabled:
        return
    if device.type != "cuda":
        raise ConfigError(KEY, f"graph_harvesting captures CUDA graphs, which need a CUDA device; this engine runs "
                               f"on '{device.type}' ({device}). Remove the key or set it to false")
    raise NotSupportedYetError(KEY, "graph_harvesting (CUDA-graph capture of the bf16 optimizer's norm and "
                                    "gradient copies) is not supported yet by zerospeed on CUDA")
