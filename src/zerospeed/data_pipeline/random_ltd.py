"""Random layerwise token dropping (random-LTD, https://arxiv.org/abs/2211.11586).

A wrapped layer sees only ``reserved_length`` randomly chosen tokens of each sequence (kept in their
order); its outputs go back to those positions and every other token passes through unchanged:

    hidden [b, s, h] --gather(idx)--> part [b, r, h] --layer--> out [b, r, h]
    result = hidden with result[:, idx] = out           (plain PyTorch gather/scatter; autograd is exact)

The first random-LTD layer of a forward draws the indices for all of them (one row per layer, shared
through the scheduler's state). Decoder models slice the attention mask to ``[:, :, :r, :r]`` (a causal
mask stays causal over the kept, sorted tokens); encoders gather the mask rows and columns per sample.
Only in training, and only while ``reserved_length`` is below the sequence length.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from ..config.data_efficiency import RandomLTDConfig
from .random_ltd_scheduler import RandomLTDScheduler


def _sorted_draw(reserved_length: int, seq_length: int, batch_size: int, layers: int,
                 device: torch.device | str) -> torch.Tensor:
    prob = torch.ones((layers * batch_size, seq_length), device=device)
    idx = torch.multinomial(prob, reserved_length).sort(dim=-1).values
    return idx.reshape(layers, batch_size, reserved_length)


def gpt_sample_tokens(reserved_length: int, seq_length: int, batch_size: int, layers: int = 1,
                      device: torch.device | str = "cpu", attn_mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sorted indices ``[layers, batch, reserved]`` and the decoder mask ``[..., :r, :r]`` (or None)."""
    idx = _sorted_draw(reserved_length, seq_length, batch_size, layers, device)
    mask = None if attn_mask is None else attn_mask[:, :, :reserved_length, :reserved_length]
    return idx, mask


def bert_sample_tokens(reserved_length: int, seq_length: int, batch_size: int, layers: int = 1,
                       device: torch.device | str = "cpu", attn_mask: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Sorted indices and, per layer, the encoder mask ``[b, 1, r, r]`` gathered at the kept tokens."""
    if attn_mask is None:
        raise ValueError("random-LTD with model_type 'encoder' needs the attention mask (model_mask_name)")
    idx = _sorted_draw(reserved_length, seq_length, batch_size, layers, device)
    masks = []
    for layer in range(layers):
        rows = [attn_mask[i:i + 1, :, idx[layer, i], :][:, :, :, idx[layer, i]] for i in range(batch_size)]
        masks.append(torch.cat(rows, dim=0))
    return idx, masks


def gather_tokens(hidden: torch.Tensor, idx: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """``hidden[b, idx[b]]`` (``[s, b, h]`` when not batch_first)."""
    h = hidden if batch_first else hidden.transpose(0, 1)
    part = h.gather(1, idx.long().unsqueeze(-1).expand(-1, -1, h.size(-1)))
    return part if batch_first else part.transpose(0, 1)


def scatter_tokens(hidden: torch.Tensor, part: torch.Tensor, idx: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """A copy of ``hidden`` with ``part`` written at ``idx`` (the inverse of ``gather_tokens``)."""
    h = hidden if batch_first else hidden.transpose(0, 1)
    p = part if batch_first else part.transpose(0, 1)
    out = h.scatter(1, idx.long().unsqueeze(-1).expand(-1, -1, h.size(-1)), p.to(h.dtype))
    return out if batch_first else out.transpose(0, 1)


class RandomLayerTokenDrop(nn.Module):
    """DeepSpeed's wrapper: ``RandomLayerTokenDrop(layer)``; configured by the engine (``init_config``)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler: RandomLTDScheduler | None = None
        self.random_ltd_layer_id = -1
        self.reserved_length = -1
        self.curr_seq = -1
        self.batch_first = True
        self.mask_name: str | None = None
        self.model_type = "decoder"

    def init_config(self, config: RandomLTDConfig, scheduler: RandomLTDScheduler, random_ltd_layer_id: int) -> None:
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = random_ltd_layer_id
        self.max_length = scheduler.state["max_value"]
        self.mask_name = config.model_mask_name
        self.random_ltd_num_layer = scheduler.random_ltd_layer_num
        self.batch_first = config.hidden_state_order == "batch_seq_dim"
        self.model_type = config.model_type

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> Any:
        sched = self.random_ltd_scheduler
        if sched is None or not self.training:
            return self.random_ltd_layer(hidden_states, **kwargs)
        self.reserved_length = sched.get_current_seq()
        seq_dim, batch_dim = (1, 0) if self.batch_first else (0, 1)
        self.curr_seq, batch = hidden_states.size(seq_dim), hidden_states.size(batch_dim)
        if self.reserved_length >= self.curr_seq:
            return self.random_ltd_layer(hidden_states, **kwargs)
        mask = kwargs[self.mask_name] if self.mask_name is not None else None
        if self.random_ltd_layer_id == 0:  # the first layer draws for all of them
            sample = gpt_sample_tokens if self.model_type == "decoder" else bert_sample_tokens
            idx, part_mask = sample(self.reserved_length, self.curr_seq, batch, self.random_ltd_num_layer,
                                    hidden_states.device, mask)
            sched.state["sample_idx"], sched.state["attention_mask"] = idx, part_mask
        else:
            idx, part_mask = sched.state["sample_idx"], sched.state["attention_mask"]
        rows = idx[self.random_ltd_layer_id]
        if self.mask_name is not None:
            kwargs[self.mask_name] = part_mask[self.random_ltd_layer_id] if self.model_type == "encoder" else part_mask
        outputs = self.random_ltd_layer(gather_tokens(hidden_states, rows, self.batch_first), **kwargs)
        if isinstance(outputs, tuple):
            return (scatter_tokens(hidden_states, outputs[0], rows, self.batch_first), *outputs[1:])
        if isinstance(outputs, torch.Tensor):
            return scatter_tokens(hidden_states, outputs, rows, self.batch_first)
        raise TypeError(f"random-LTD supports layers returning a tensor or a tuple, got {type(outputs).__name__}")


def convert_to_random_ltd(model: Any, convert_type: type[nn.Module]) -> Any:
    """Wrap every ``convert_type`` submodule in ``RandomLayerTokenDrop``; ``model`` is the engine (or has a
    ``random_ltd_initialize``), which then picks the layers of ``random_ltd_layer_id``. Returns ``model``."""
    if not callable(getattr(model, "random_ltd_initialize", None)):
        raise ValueError("convert_to_random_ltd(model, ...) needs the engine zerospeed.initialize() returned (with "
                         "data_efficiency.data_routing.random_ltd enabled), which configures the wrapped layers")
    inner = model.module if hasattr(model, "module") else model
    targets = [name for name, m in inner.named_modules() if isinstance(m, convert_type) and name]
    for name in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = inner.get_submodule(parent_name) if parent_name else inner
        setattr(parent, leaf, RandomLayerTokenDrop(getattr(parent, leaf)))
    model.random_ltd_initialize()
    return model


def remove_random_ltd_state_dict(state_dict: dict[str, Any]) -> "OrderedDict[str, Any]":
    """Keys without the wrapper's ``.random_ltd_layer`` (loadable into the unwrapped model)."""
    return OrderedDict((k.replace(".random_ltd_layer", ""), v) for k, v in state_dict.items())


def save_without_random_ltd(model: Any) -> "OrderedDict[str, Any]":
    inner = model.module if hasattr(model, "module") else model
    return remove_random_ltd_state_dict(inner.state_dict())


def init_random_ltd_layers(module: nn.Module, config: RandomLTDConfig, scheduler: RandomLTDScheduler) -> int:
    """DeepSpeed's ``random_ltd_initialize``: walk the wrapped layers in module order and configure those whose
    name contains the next of the sorted ``random_ltd_layer_id`` (as text: ``1`` matches ``blocks.1``, also
    ``blocks.10``, exactly as DeepSpeed). Raises unless it finds ``random_ltd_layer_num`` of them."""
    queue = sorted(config.random_ltd_layer_id)
    count = 0
    for name, layer in module.named_modules():
        if isinstance(layer, RandomLayerTokenDrop) and queue and str(queue[0]) in name:
            layer.init_config(config, scheduler, count)
            queue.pop(0)
            count += 1
    if config.random_ltd_layer_num != count:
        raise ValueError(f"random_ltd_layer_num {config.random_ltd_layer_num} must be equivalent to the len of "
                         f"random_ltd_layer_id {count} (the wrapped layers found for random_ltd_layer_id "
                         f"{config.random_ltd_layer_id})")
    return count
