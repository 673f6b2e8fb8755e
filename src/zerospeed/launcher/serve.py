"""``zerospeed serve MODEL_DIR``: an OpenAI-compatible HTTP server (needs the ``serve`` extra).

MODEL_DIR is a Hugging Face causal-LM directory (GPT-2, Llama) or a zerospeed GPT saved with
``zerospeed.inference.model_dir.save_gpt_dir``. ``--config`` takes DeepSpeed-FastGen's engine config
(``state_manager`` limits, KV blocks). Imports torch only when run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from zerospeed.launcher.command import Command, UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="model directory (Hugging Face or zerospeed GPT)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--config", default=None, help="JSON file: FastGen engine config (state_manager, ...)")
    parser.add_argument("--kv-blocks", type=int, default=1024,
                        help="KV-cache blocks when the config gives no memory_config (default 1024)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])


def engine_config(config_path: str | None, kv_blocks: int) -> dict[str, Any]:
    """The user's FastGen config, with ``memory_config`` defaulting to ``allocate`` ``kv_blocks`` blocks."""
    cfg: dict[str, Any] = json.loads(Path(config_path).read_text()) if config_path else {}
    sm = cfg.setdefault("state_manager", cfg.pop("manager", {}))
    sm.setdefault("memory_config", {"mode": "allocate", "size": kv_blocks})
    return cfg


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        raise UsageError("zerospeed serve needs the serve extra: pip install 'zerospeed[serve]'") from None
    from zerospeed.inference.config import parse_dtype
    from zerospeed.inference.model_dir import load_model_dir
    from zerospeed.inference.server import create_app
    from zerospeed.inference.serving import ServingEngine

    try:
        loaded = load_model_dir(args.model_dir, parse_dtype(args.dtype))
        engine = ServingEngine(loaded.model, engine_config(args.config, args.kv_blocks),
                               decode=loaded.tokenizer.decode, eos_token_ids=loaded.eos_token_ids)
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    uvicorn.run(create_app(loaded, engine), host=args.host, port=args.port, log_level="info")
    return 0


COMMAND = Command(
    name="serve",
    help="serve a model over an OpenAI-compatible HTTP API",
    description="Serve MODEL_DIR with continuous batching over a paged KV cache: /v1/completions, "
    "/v1/chat/completions (SSE streaming), /v1/models, /health, /metrics.",
    add_arguments=add_arguments,
    run=run,
)
