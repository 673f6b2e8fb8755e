"""What tensor parallelism should send per training step, layer by layer, to compare with the comms logger.

Message bytes as ``comm`` counts them (the full tensor of an all-reduce; the gathered output of an all-gather;
the input of a reduce-scatter), for ``tokens`` = batch x sequence tokens through the model per step:

    column layer (LinearLayer)     backward: all-reduce of the input gradient    tokens x in  x bytes
    row layer (LinearAllreduce)    forward:  all-reduce of the output            tokens x out x bytes
    gather_output (column)         forward:  all-gather of the output            tokens x out x bytes
    under sequence parallelism: each all-reduce becomes an all-gather (column forward / row backward) and a
    reduce-scatter (row forward / column backward) of the same full size; besides, each column layer gathers
    its input again in backward (it keeps only ``seq/tp`` tokens), the region's entry (backward) and exit
    (forward) gather ``tokens x hidden`` once each, and the parameters replicated inside the region (norms,
    row biases) all-reduce their gradients.

For a GPT block (qkv, proj, fc, proj) that is the textbook 2 all-reduces of ``b·s·h`` forward and 2 backward.
"""

from __future__ import annotations

from torch import nn


def expected_tp_bytes(model: nn.Module, tokens: int) -> dict[str, int]:
    """Bytes per step by collective for ``tokens`` tokens through ``model`` (forward and backward)."""
    from .column import LinearLayer
    from .row import LinearAllreduce

    from .model_init import tp_state

    out = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    state = tp_state(model)
    sync = getattr(state, "sequence_parallel", None)
    for p in getattr(sync, "params", []):
        out["all_reduce"] += p.numel() * p.element_size()
    hidden = 0
    for mod in model.modules():
        if getattr(mod, "tp_world_size", 1) <= 1:
            continue
        nbytes = mod.weight.element_size()
        if isinstance(mod, LinearLayer):
            full_out = sum(mod.partition_sizes)
            if mod.sequence_parallel:
                out["all_gather"] += 2 * tokens * mod.in_features * nbytes  # forward, and again in backward
                out["reduce_scatter"] += tokens * mod.in_features * nbytes
                hidden = mod.in_features
            else:
                out["all_reduce"] += tokens * mod.in_features * nbytes
            if mod.gather_output:
                out["all_gather"] += tokens * full_out * nbytes
        elif isinstance(mod, LinearAllreduce):
            size = mod.weight.shape[0] * tokens * nbytes
            if mod.sequence_parallel:
                out["reduce_scatter"] += size
                out["all_gather"] += size
                if mod.bias is not None:
                    out["all_reduce"] += mod.bias.numel() * nbytes
            else:
                out["all_reduce"] += size
    if sync is not None:  # entering (backward) and leaving (forward) the sequence-parallel region
        out["all_gather"] += 2 * tokens * hidden * model_bytes(model)
    return out


def model_bytes(model: nn.Module) -> int:
    return next(model.parameters()).element_size()
