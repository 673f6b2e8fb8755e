"""Load a model directory for serving: a Hugging Face causal LM, or a zerospeed GPT saved by ``save_gpt_dir``.

A zerospeed GPT directory holds ``config.json`` (``"model_type": "zerospeed-gpt"`` and the ``GPTConfig``
fields) and ``model.safetensors``; its tokenizer is UTF-8 bytes (one token per byte). Any other directory is
read with ``transformers``' ``AutoModelForCausalLM`` / ``AutoTokenizer`` (no network: local files only).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["ByteTokenizer", "LoadedModel", "load_model_dir", "save_gpt_dir"]

GPT_TYPE = "zerospeed-gpt"


class ByteTokenizer:
    """UTF-8 bytes as tokens; decoding replaces an incomplete trailing character with U+FFFD."""

    eos_token_id = None
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # .encode(str) -> ids, .decode(ids) -> str, optional chat template
    name: str
    eos_token_ids: tuple[int, ...]


def save_gpt_dir(model: nn.Module, path: str | Path) -> Path:
    """Write a ``zerospeed.models.GPT`` as a servable directory."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"model_type": GPT_TYPE, **dataclasses.asdict(model.config)}))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied to wte
    save_file(state, str(out / "model.safetensors"))
    return out


def load_model_dir(path: str | Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The model (eval mode, ``dtype``), its tokenizer and eos ids, from a directory."""
    root = Path(path)
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{root} has no config.json: not a model directory")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("model_type") == GPT_TYPE:
        from safetensors.torch import load_file

        from zerospeed.models.gpt import GPT, GPTConfig

        fields = {f.name for f in dataclasses.fields(GPTConfig)}
        model = GPT(GPTConfig(**{k: v for k, v in cfg.items() if k in fields}))
        missing, unexpected = model.load_state_dict(load_file(str(root / "model.safetensors")), strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise ValueError(f"{root}: weights do not match the config (missing {missing}, unexpected {unexpected})")
        return LoadedModel(model.to(dtype).eval(), ByteTokenizer(), root.name, ())
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ValueError("serving a Hugging Face model directory needs `transformers` installed") from exc
    model = AutoModelForCausalLM.from_pretrained(str(root), dtype=dtype, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    return LoadedModel(model, tok, root.name, eos_ids)
