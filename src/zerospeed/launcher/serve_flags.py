"""vLLM's ``serve`` flags for ``zerospeed serve``, mapped onto DeepSpeed-FastGen's engine config.

| vLLM flag | zerospeed |
|---|---|
| ``--max-model-len`` | ``state_manager.max_context`` |
| ``--max-num-seqs`` | ``state_manager.max_ragged_sequence_count`` (sequences per forward) |
| ``--max-num-batched-tokens`` | ``state_manager.max_ragged_batch_size`` (tokens per forward) |
| ``--block-size`` | ``state_manager.kv_block_size`` |
| ``--kv-cache-memory`` | ``state_manager.memory_config.size``: bytes (``2GiB``, ``500MB``, ``123456``) or a fraction of free memory (``0.3``) turned into KV blocks for this model |
| ``--tensor-parallel-size`` / ``-tp`` | ``--tp-size`` |
| ``--quantization`` | ``--quant`` (``int8``, ``int4``) |

A flag given on the command line wins over the same key in ``--config``. An unknown flag is an error with a
did-you-mean (``parse_known_args`` of the serve parser checks what is left over).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
from typing import Any

from zerospeed.launcher.command import UsageError

__all__ = ["add_vllm_arguments", "apply_vllm_flags", "check_unknown", "kv_blocks_for", "parse_memory"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="names clients use in 'model' (one or several; default: the directory's name)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $ZEROSPEED_API_KEY)")
    parser.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens per request")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="sequences per forward")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per forward")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block")
    parser.add_argument("--kv-cache-memory", default=None,
                        help="KV-cache size: bytes (e.g. 2GiB) or a fraction of free memory (e.g. 0.3)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed for requests that give none (sampled outputs reproducible across runs)")
    parser.add_argument("--chat-template", default=None,
                        help="Jinja chat template (a file, or the template text) replacing the tokenizer's")
    parser.add_argument("--enable-prefix-caching", action="store_true",
                        help="share the KV blocks of equal prompt prefixes across requests")
    parser.add_argument("--speculative-config", default=None,
                        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (prompt lookup)')


def check_unknown(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """Refuse leftover arguments, suggesting the closest known flag."""
    if not extra:
        return
    flags = sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--")})
    bad = next((e for e in extra if e.startswith("-")), extra[0])
    close = difflib.get_close_matches(bad.split("=")[0], flags, n=1, cutoff=0.6)
    hint = f". Did you mean '{close[0]}'?" if close else ""
    raise UsageError(f"unrecognized argument '{bad}'{hint}")


def parse_memory(text: str) -> tuple[int | None, float | None]:
    """``(bytes, None)`` or ``(None, fraction)`` from ``--kv-cache-memory``; UsageError if neither."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise UsageError(f"--kv-cache-memory: expected bytes (e.g. 2GiB, 500MB) or a fraction (0.3), got {text!r}")
    value, unit = float(m.group(1)), m.group(2).lower()
    if not unit and 0.0 < value < 1.0:
        return None, value
    if value < 1:
        raise UsageError(f"--kv-cache-memory must be > 0 bytes or a fraction in (0, 1), got {text!r}")
    return int(value * _UNITS[unit]), None


def kv_blocks_for(model: Any, memory: str, block_size: int, dtype_bytes: int, tp: int) -> int:
    """KV blocks that fit ``memory`` for ``model`` (keys and values of every layer; heads split over ``tp``)."""
    from zerospeed.inference.adapters import adapter_for

    nbytes, fraction = parse_memory(memory)
    if fraction is not None:
        nbytes = int(fraction * _free_memory())
    a = adapter_for(model)
    per_block = 2 * a.num_layers * max(1, a.num_kv_heads // tp) * a.head_dim * block_size * dtype_bytes
    blocks = int(nbytes or 0) // per_block
    if blocks < 1:
        raise UsageError(f"--kv-cache-memory {memory} holds no KV block of this model ({per_block} bytes each)")
    return blocks


def _free_memory() -> int:
    """Free memory of the device the server runs on (the accelerator's view: CUDA free bytes, else host RAM)."""
    from ..accelerator import get_accelerator

    return get_accelerator().available_memory()


def apply_vllm_flags(args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with the state-manager limits that vLLM flags set (each must be >= 1)."""
    if args.speculative_config:
        from zerospeed.inference.speculative import SpeculativeConfig

        try:
            args.speculative = SpeculativeConfig.parse(json.loads(args.speculative_config))
        except (ValueError, TypeError) as exc:
            raise UsageError(f"--speculative-config: {exc}") from None
    else:
        args.speculative = None
    sm = cfg["state_manager"]
    for flag, key in (("max_model_len", "max_context"), ("max_num_seqs", "max_ragged_sequence_count"),
                      ("max_num_batched_tokens", "max_ragged_batch_size"), ("block_size", "kv_block_size")):
        value = getattr(args, flag)
        if value is not None:
            if value < 1:
                raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
            sm[key] = value
    if args.kv_cache_memory is not None:
        parse_memory(args.kv_cache_memory)  # fail before the model loads
    return cfg
