"""``init_inference``: DeepSpeed's inference entry point — cast, optionally quantize, decode with a KV cache.

``InferenceEngine`` wraps the user's model like DeepSpeed's: ``engine.module`` is the model, ``engine(...)``
runs its forward without autograd, and ``engine.generate(input_ids, ...)`` decodes with zerospeed's paged KV
cache (the prompt runs once, then one token per step) for the model families in ``adapters``. Greedy
decoding matches Hugging Face ``generate`` token for token in fp32. Beam search and other decoding modes of
Hugging Face raise ``NotSupportedYetError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerospeed.accelerator import get_accelerator
from zerospeed.config.errors import NotSupportedYetError

from .adapters import DecoderAdapter, adapter_for
from .compiled import CompiledRegion, default_backend
from .config import DeepSpeedInferenceConfig, load_inference_config
from .beam_search import beam_search
from .generate import generate_tokens
from .sampling import SamplingParams

__all__ = ["InferenceEngine", "init_inference"]

_GENERATE_DEFAULTS: dict[str, Any] = {"num_beams": 1, "num_return_sequences": 1, "use_cache": True,
                                      "repetition_penalty": 1.0, "return_dict_in_generate": False}


def init_inference(model: nn.Module, config: str | Path | dict[str, Any] | None = None,
                   **kwargs: Any) -> InferenceEngine:
    """DeepSpeed's ``init_inference(model, config=None, **kwargs)``: kwargs merge into the config."""
    return InferenceEngine(model, load_inference_config(config, kwargs))


class InferenceEngine(nn.Module):
    """The wrapped model, its compute dtype, and a KV-cache ``generate``."""

    def __init__(self, model: nn.Module, config: DeepSpeedInferenceConfig) -> None:
        super().__init__()
        config.check_supported()
        self._config = config
        model.eval()
        model.to(get_accelerator().device())
        wq = config.weight_quantization
        if config.dtype is not torch.int8:
            model.to(config.dtype)
        self.module = model
        self._adapter: DecoderAdapter | None = None
        self.tp_group: Any = None
        if config.tp_size > 1:
            from .tensor_parallel import shard_for_inference

            self.tp_group = _tp_group(config)
            shard_for_inference(self.adapter, self.tp_group, config.tensor_parallel.tp_grain_size)
        if wq is not None:  # after sharding: each rank quantizes its own shards (per-shard group scales)
            from .quantization import quantize_model

            quantize_model(model, wq)
        self._forward: CompiledRegion | None = None
        self._compiled = False
        if config.replace_with_kernel_inject:
            self.compile()

    @property
    def config(self) -> DeepSpeedInferenceConfig:
        return self._config

    @property
    def adapter(self) -> DecoderAdapter:
        if self._adapter is None:
            self._adapter = adapter_for(self.module)
        return self._adapter

    def compile(self, backend: str | Any | None = None, compile_kwargs: dict[str, Any] | None = None) -> None:
        """DeepSpeed's ``engine.compile(backend, compile_kwargs)``: ``torch.compile`` the forward and the
        decode regions (norm+QKV, out-proj+MLP, norm+head) with an eager fallback; idempotent."""
        if self._compiled:
            return
        backend = backend or default_backend()
        self._forward = CompiledRegion(self.module, "forward", backend, compile_kwargs, dynamic=None)
        try:
            self.adapter.compile(backend, compile_kwargs)
        except NotSupportedYetError:
            pass  # no adapter for this model: only its forward is compiled; generate will name the model
        self._compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return (self._forward or self.module)(*args, **kwargs)

    def _generation_default(self, name: str, fallback: Any) -> Any:
        gc = getattr(self.module, "generation_config", None)
        value = getattr(gc, name, None) if gc is not None else None
        return fallback if value is None else value

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int | None = None, max_length: int | None = None, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                 **kwargs: Any) -> torch.Tensor:
        """Hugging Face's ``generate`` contract for greedy and sampled decoding: ``[B, T + new]`` token ids.

        ``attention_mask`` may mark left padding (each row is decoded without its pads). Rows that end early
        are filled with ``pad_token_id`` (default: the eos id), as Hugging Face does.
        """
        beams = {k: kwargs.pop(k) for k in ("num_beams", "num_return_sequences", "length_penalty", "early_stopping")
                 if k in kwargs}
        num_beams = beams.get("num_beams") or self._generation_default("num_beams", 1)
        for key, value in kwargs.items():
            if key not in _GENERATE_DEFAULTS or value != _GENERATE_DEFAULTS[key]:
                raise NotSupportedYetError(f"generate.{key}", f"generate({key}={value!r}): not supported yet by zerospeed")
        if num_beams == 1 and beams.get("num_return_sequences", 1) != 1:
            raise NotSupportedYetError("generate.num_return_sequences", "num_return_sequences > 1 without beam "
                                       "search: not supported yet by zerospeed")
        if num_beams > 1 and do_sample:
            raise NotSupportedYetError("generate.do_sample", "beam sampling (num_beams > 1 with do_sample=True): "
                                       "not supported yet by zerospeed")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        prompts = _unpad(input_ids, attention_mask)
        width = input_ids.shape[1]
        if max_new_tokens is None:
            max_new_tokens = (max_length or self._generation_default("max_length", 20)) - width
        if max_new_tokens < 1:
            raise ValueError(f"nothing to generate: max_new_tokens={max_new_tokens} (prompt is {width} tokens)")
        self._check_length(max(len(p) for p in prompts), max_new_tokens)
        eos = self._generation_default("eos_token_id", None) if eos_token_id is None else eos_token_id
        eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        if num_beams > 1:
            if attention_mask is not None and not bool(attention_mask.all()):
                raise NotSupportedYetError("generate.attention_mask", "beam search over padded prompts: not "
                                           "supported yet by zerospeed")
            pad = self._generation_default("pad_token_id", None) if pad_token_id is None else pad_token_id
            out = beam_search(self.adapter, prompts, num_beams, max_new_tokens, sorted(eos_ids),
                              beams.get("length_penalty", self._generation_default("length_penalty", 1.0)),
                              beams.get("early_stopping", self._generation_default("early_stopping", False)),
                              beams.get("num_return_sequences", 1), pad)
            return out.to(device=input_ids.device, dtype=input_ids.dtype)
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature if do_sample else 0.0,
                                top_k=top_k, top_p=top_p, seed=seed)
        new, _ = generate_tokens(self.adapter, prompts, max_new_tokens, params, eos_ids)
        pad = self._generation_default("pad_token_id", None) if pad_token_id is None else pad_token_id
        if pad is None:
            pad = min(eos_ids) if eos_ids else 0
        longest = max(len(n) for n in new)
        tail = torch.full((len(new), longest), pad, dtype=input_ids.dtype, device=input_ids.device)
        for i, n in enumerate(new):
            tail[i, : len(n)] = torch.tensor(n, dtype=input_ids.dtype)
        return torch.cat([input_ids, tail], dim=1)

    def _check_length(self, prompt_len: int, new: int) -> None:
        cfg = self._config
        if prompt_len + new > cfg.max_out_tokens:
            raise ValueError(f"prompt ({prompt_len}) + new tokens ({new}) exceed max_out_tokens={cfg.max_out_tokens}; "
                             "raise max_out_tokens in the inference config")
        if cfg.max_out_tokens - prompt_len < cfg.min_out_tokens:
            raise ValueError(f"only {cfg.max_out_tokens - prompt_len} tokens fit after the prompt, fewer than "
                             f"min_out_tokens={cfg.min_out_tokens}")
        limit = self.adapter.max_positions
        if limit is not None and prompt_len + new > limit:
            raise ValueError(f"prompt ({prompt_len}) + new tokens ({new}) exceed the model's {limit} positions")


def _tp_group(config: DeepSpeedInferenceConfig) -> Any:
    """The tensor-parallel group: ``tensor_parallel.tp_group``, the ``mpu``'s, or the world when it has tp ranks.
    Under a launcher (``WORLD_SIZE`` set) with no process group yet, it joins one first, as DeepSpeed does."""
    import os

    from .. import comm
    from .tensor_parallel import resolve_tp_group

    if not comm.is_initialized() and "WORLD_SIZE" in os.environ:  # started by a launcher: join, as DeepSpeed does
        comm.init_distributed()
    group = config.tensor_parallel.tp_group
    mpu = config.tensor_parallel.mpu or config.mpu
    if group is None and mpu is not None:
        group = mpu.get_tensor_model_parallel_group()
    return resolve_tp_group(config.tp_size, group, "run under `zerospeed` / torchrun and call "
                            "zerospeed.init_distributed()")


def _unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's real tokens; only left padding (zeros before the first one) is accepted."""
    if attention_mask is None:
        return input_ids.tolist()
    rows = []
    for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
        first = mask.index(1) if 1 in mask else len(mask)
        if any(m != 1 for m in mask[first:]):
            raise NotSupportedYetError("generate.attention_mask",
                                       "right padding or holes in attention_mask: not supported yet by zerospeed "
                                       "(pad on the left)")
        rows.append(ids[first:])
    return rows
