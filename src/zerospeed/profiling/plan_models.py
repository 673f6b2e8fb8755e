"""What ``zerospeed plan`` knows about a model: parameter sizes (built on the meta device) and activations.

A :class:`ModelSpec` is built without allocating anything: the model is constructed under
``torch.device("meta")``, and only each parameter's element count (tied parameters once, as
``model.parameters()`` yields them) and whether it trains are kept.

Activations are formulas, per architecture, of the bytes autograd *saves* between forward and backward
for one micro-batch (``b`` sequences of ``t`` tokens; ``c`` = n_embd, ``h`` = n_head, ``V`` = vocabulary,
``L`` = layers, ``e`` = bytes per element of the compute dtype; LayerNorm statistics, attention
log-sum-exp and the loss's log-softmax stay fp32). Every term was read off the autograd graph (saved-tensor
hooks) and ``tests/unit/test_plan.py`` checks the totals against it exactly:

* zerospeed GPT (``models/gpt.py``), per layer: 16·b·t·c·e (LN inputs 2, LN outputs 2, qkv 3, attention
  output 1, MLP 4+4 and their inputs) + 4 LayerNorm statistics ·b·t·4 + attention LSE b·h·t·4;
  after the layers: final LN input and output 2·b·t·c·e, its statistics 2·b·t·4, log-softmax b·t·V·4,
  the loss's scalar, positions t·8.
* Hugging Face GPT-2 (SDPA attention, ``gelu_new``, dropout 0): per layer 30·b·t·c·e (``gelu_new`` is
  written in Python and saves four 4c-wide intermediates besides the MLP input: 20·c of the 30) + the same
  statistics and LSE; after the layers as above plus the shifted labels b·t·8.

Dropout > 0 adds masks (and, in GPT-2's attention, the materialised t×t scores); the formulas refuse it
rather than guess.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GPT_PRESETS = ("tiny", "demo", "bench")
# Named GPT-2 configs built locally (no download): sizes of the Hugging Face GPT-2 family, and a tiny one.
HF_NAMED: dict[str, dict[str, int]] = {
    "gpt2-tiny": {"vocab_size": 512, "n_positions": 128, "n_embd": 128, "n_layer": 4, "n_head": 4},
    "gpt2-test": {"vocab_size": 256, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 2},
    "gpt2": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12},
    "gpt2-medium": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 1024, "n_layer": 24, "n_head": 16},
}

# Measured constants: how far the steady-state peak rises above the saved activations (backward's own
# temporaries, e.g. gelu_new's Python backward and the logits' gradients when heap-sized, and the heap that
# training leaves fragmented from step to step). Fit 2026-12-01 on the code of that day (benchmarks/bench_plan.py,
# world 2, micro-batch 8 x seq 128, stages 0-3, three runs, both ranks): the mean of (measured - planned states
# - FRAMEWORK_BYTES) / saved activations over the 24 readings, gpt:demo (1.505) and hf:gpt2-tiny (1.906).
GPT_BACKWARD_FACTOR = 1.5
GPT2_BACKWARD_FACTOR = 1.9


@dataclass(frozen=True)
class Shape:
    """The transformer dimensions the activation formulas need."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    max_seq: int


@dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it: parameter sizes in ``parameters()`` order and saved activations."""

    name: str
    numels: tuple[int, ...]
    trainable: tuple[bool, ...]
    shape: Shape
    activation_bytes: Callable[[Shape, int, int, int], int]  # (shape, micro_batch, seq, element bytes)
    backward_factor: float  # measured: steady-state backward peak / saved activations

    @property
    def num_params(self) -> int:
        return sum(self.numels)

    def activations(self, micro_batch: int, seq: int, element_bytes: int) -> int:
        if seq > self.shape.max_seq:
            raise ValueError(f"--seq {seq} exceeds the model's maximum sequence length {self.shape.max_seq}")
        return self.activation_bytes(self.shape, micro_batch, seq, element_bytes)


def _common(s: Shape, b: int, t: int, e: int, per_layer_widths: int) -> int:
    c, h = s.n_embd, s.n_head
    per_layer = per_layer_widths * b * t * c * e + 4 * b * t * 4 + b * h * t * 4
    tail = 2 * b * t * c * e + 2 * b * t * 4 + b * t * s.vocab_size * 4 + 4  # + the loss's saved scalar
    return s.n_layer * per_layer + tail


def gpt_activation_bytes(s: Shape, b: int, t: int, e: int) -> int:
    """Saved activations of zerospeed's GPT for one micro-batch (formula; see the module docstring)."""
    return _common(s, b, t, e, 16) + t * 8


def hf_gpt2_activation_bytes(s: Shape, b: int, t: int, e: int) -> int:
    """Saved activations of Hugging Face's GPT2LMHeadModel (SDPA, gelu_new, no dropout) for one micro-batch."""
    return _common(s, b, t, e, 30) + b * t * 8 + t * 8


def _spec_of(name: str, model: Any, shape: Shape, formula: Callable[[Shape, int, int, int], int],
             factor: float) -> ModelSpec:
    params = list(model.parameters())
    return ModelSpec(name, tuple(p.numel() for p in params), tuple(p.requires_grad for p in params), shape, formula,
                     factor)


def _gpt(preset: str) -> ModelSpec:
    import torch

    from ..models import gpt

    if preset not in GPT_PRESETS:
        raise ValueError(f"unknown GPT preset {preset!r}; choose one of {', '.join(GPT_PRESETS)}")
    cfg = getattr(gpt, preset)()
    if cfg.dropout:
        raise ValueError("the activation formula assumes dropout 0")
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    shape = Shape(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.block_size)
    return _spec_of(f"gpt:{preset}", model, shape, gpt_activation_bytes, GPT_BACKWARD_FACTOR)


def hf_gpt2_config(source: str) -> Any:
    """A ``transformers.GPT2Config`` from a named config (``HF_NAMED``), a config.json, or a directory holding one."""
    import transformers

    if source in HF_NAMED:
        fields: dict[str, Any] = dict(HF_NAMED[source])
    else:
        path = os.path.join(source, "config.json") if os.path.isdir(source) else source
        if not os.path.isfile(path):
            raise ValueError(f"hf:{source}: not a named config ({', '.join(HF_NAMED)}) nor a config.json "
                             "(nothing is downloaded)")
        with open(path, encoding="utf-8") as f:
            fields = json.load(f)
        if fields.get("model_type", "gpt2") != "gpt2":
            raise ValueError(f"hf:{source}: model_type {fields.get('model_type')!r} has no activation formula "
                             "yet (GPT-2 only); not supported yet by zerospeed plan")
    fields.update({k: 0.0 for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop") if k not in fields})
    cfg = transformers.GPT2Config(**{k: v for k, v in fields.items() if k != "model_type"})
    if cfg.resid_pdrop or cfg.embd_pdrop or cfg.attn_pdrop:
        raise ValueError(f"hf:{source}: dropout > 0 saves masks the GPT-2 activation formula does not count; "
                         "not supported yet by zerospeed plan (set resid_pdrop, embd_pdrop, attn_pdrop to 0)")
    return cfg


def _hf(source: str) -> ModelSpec:
    import torch
    import transformers

    cfg = hf_gpt2_config(source)
    model_cls = transformers.GPT2LMHeadModel  # imported outside the meta context (its imports register ops)
    with torch.device("meta"):
        model = model_cls(cfg)
    shape = Shape(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.n_positions)
    return _spec_of(f"hf:{source}", model, shape, hf_gpt2_activation_bytes, GPT2_BACKWARD_FACTOR)


def model_spec(name: str) -> ModelSpec:
    """``gpt:<preset>`` (zerospeed GPT presets) or ``hf:<named config | config.json | dir>`` (GPT-2)."""
    kind, _, arg = name.partition(":")
    if kind == "gpt" and arg:
        return _gpt(arg)
    if kind == "hf" and arg:
        return _hf(arg)
    raise ValueError(f"--model {name!r}: expected gpt:<{'|'.join(GPT_PRESETS)}> or hf:<{'|'.join(HF_NAMED)}|"
                     "path/to/config.json>")
