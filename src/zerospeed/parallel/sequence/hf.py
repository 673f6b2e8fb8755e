"""Ulysses for Hugging Face transformers models (DeepSpeed's ``UlyssesSPAttentionHF``).

transformers calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, ...)`` with
``[batch, heads, seq, head_dim]`` tensors and takes back ``([batch, seq, heads, head_dim], weights)``.
``register_with_transformers`` puts a wrapper under the core implementation's own key (as DeepSpeed does,
so every ``_attn_implementation == "sdpa"`` branch of transformers still runs): each rank's ``seq/P``
positions of all heads become all positions of its heads (``all_to_all.seq_to_head``, GQA-aware), the
original attention runs with the causal flag instead of the local-length mask, and the output returns to
``seq/P`` positions. Works for every model whose attention goes through that table (Llama, Qwen2, Mistral,
GPT-2, ...). When registered with a loaded model, only that model's attention modules are wrapped.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ... import comm
from ...config.errors import NotSupportedYetError
from .all_to_all import all_to_all_seq_heads, plan_heads
from .groups import SequenceParallelGrid

__all__ = ["UlyssesSPAttentionHF"]

_SUPPORTED = ("sdpa",)


class UlyssesSPAttentionHF(nn.Module):
    """``attn``: the transformers attention function to run on the whole sequence of the rank's heads.

    Constructor arguments as DeepSpeed's (``batch_size``, head counts and sizes, ``process_group``, fixed or
    variable sequence length, ``disable_in_eval``); with a fixed length the incoming shapes are checked.
    """

    def __init__(self, attn: Any, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group: Any, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = comm.get_world_size(process_group)
        self.sp_rank = comm.get_rank(process_group)
        self.batch_size = batch_size
        self.attn_head_count, self.attn_head_size = attn_head_count, attn_head_size
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        self.plan = plan_heads(attn_head_count, kv_head_count, self.world_size)  # raises on unsplittable counts
        if not seq_length_is_variable and local_seq_length is None:
            raise ValueError("a fixed sequence length needs local_seq_length (or seq_length_is_variable=True)")
        self.modules_to_wrap: weakref.WeakSet[nn.Module] | None = None  # None: every attention module

    def _check(self, query: torch.Tensor, key: torch.Tensor) -> None:
        b, h, s, d = query.shape
        want_s = s if self.seq_length_is_variable else self.local_seq_length
        if (b, h, s, d) != (self.batch_size, self.attn_head_count, want_s, self.attn_head_size) \
                or key.shape[1] != self.global_kv_head_count:
            raise ValueError(f"rank {comm.get_rank()}: query {tuple(query.shape)} / key {tuple(key.shape)} do not "
                             f"match [batch {self.batch_size}, heads {self.attn_head_count} (kv "
                             f"{self.global_kv_head_count}), local seq {want_s}, head size {self.attn_head_size}]")

    def forward(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """``[b, h, s/P, d]`` q/k/v in; ``([b, s/P, h, d], weights)`` out, as transformers expects."""
        skip = (self.modules_to_wrap is not None and module not in self.modules_to_wrap) or \
            (self.disable_in_eval and not module.training)
        if skip:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check(query, key)
        plan = self.plan
        if plan.kv_repeat > 1:  # fewer kv heads than ranks: every rank gets one (repeated) kv head
            key = key.repeat_interleave(plan.kv_repeat, dim=1)
            value = value.repeat_interleave(plan.kv_repeat, dim=1)
        q = all_to_all_seq_heads(query, self.process_group, 2, 1, plan.q_splits)
        k = all_to_all_seq_heads(key, self.process_group, 2, 1, plan.kv_splits)
        v = all_to_all_seq_heads(value, self.process_group, 2, 1, plan.kv_splits)
        # The mask transformers built covers the local length only: attend causally over the whole sequence.
        kwargs.pop("is_causal", None)
        kwargs.pop("position_ids", None)  # local positions; sdpa does not read them
        groups = getattr(module, "num_key_value_groups", None)
        if groups is not None:
            module.num_key_value_groups = q.shape[1] // k.shape[1]
        try:
            out, weights = self.attn(module, q, k, v, None, *args, is_causal=True, **kwargs)
        finally:
            if groups is not None:
                module.num_key_value_groups = groups
        return all_to_all_seq_heads(out, self.process_group, 1, 2, plan.q_splits, to_heads=False), weights

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None) -> SequenceParallelGrid | None:
        """Wrap ``core_attn_implementation`` with Ulysses and return the sequence grid to pass as
        ``initialize(mpu=...)`` (None when ``sequence_parallel_size`` is 1), as DeepSpeed does.

        ``model_name_or_path``: a loaded model (only its attention modules are wrapped), or a name/path
        whose config gives the head counts (then every model using the implementation is wrapped).
        """
        if sequence_parallel_size == 1:
            return None
        if seq_length is None:
            seq_length = max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("set seq_length (the fixed global sequence length) or seq_length_is_variable=True")
        if core_attn_implementation not in _SUPPORTED:
            raise NotSupportedYetError("core_attn_implementation", f"Ulysses over '{core_attn_implementation}' "
                                       f"attention is not supported yet by zerospeed (supported: {_SUPPORTED}); "
                                       "eager attention needs a whole-sequence 4D mask and is refused by DeepSpeed too")
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        loaded = hasattr(model_name_or_path, "config")
        config = model_name_or_path.config if loaded else AutoConfig.from_pretrained(model_name_or_path)
        used = getattr(config, "_attn_implementation", None) if loaded else None
        if used is not None and used != core_attn_implementation:
            raise ValueError(f"core_attn_implementation='{core_attn_implementation}' does not match the model's "
                             f"attn_implementation='{used}'; load the model with attn_implementation="
                             f"'{core_attn_implementation}'")
        grid = SequenceParallelGrid(sequence_parallel_size)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head")
        hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd")
        kv = getattr(text, "num_key_value_heads", None) or heads
        local = None if seq_length_is_variable else seq_length // sequence_parallel_size
        uattn = cls(ALL_ATTENTION_FUNCTIONS[core_attn_implementation], micro_batch_size, heads,
                    getattr(text, "head_dim", None) or hidden // heads, kv,
                    getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer"), grid.sp_group,
                    seq_length_is_variable, local, None if seq_length_is_variable else seq_length, disable_in_eval)
        if loaded and isinstance(model_name_or_path, nn.Module):
            uattn.modules_to_wrap = weakref.WeakSet(model_name_or_path.modules())

        def uattn_wrapper(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
            return uattn(module, query, key, value, attention_mask, *args, **kwargs)

        uattn_wrapper.ulysses = uattn  # type: ignore[attr-defined]
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = uattn_wrapper
        return grid
