"""``redundancy_clean`` (issue 35): pruned models really get smaller (rows, heads, channels, layers) and compute
what the masked model computed; layer reduction keeps the teacher's layers; DeepSpeed's import paths; tier 0."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerospeed.compression import init_compression, redundancy_clean
from zerospeed.compression.scheduler import CompressionScheduler
from zerospeed.models.gpt import GPT, tiny


def _cfg(**techniques: dict[str, Any]) -> dict[str, Any]:
    return {"compression_training": techniques}


def _tech(shared: dict[str, Any], params: dict[str, Any], modules: list[str], related: list[list[str]]) -> dict[str, Any]:
    return {"shared_parameters": {"enabled": True, "schedule_offset": 0, **shared},
            "different_groups": {"g": {"params": params, "modules": modules, "related_modules": related}}}


def _n(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_head_and_row_pruning_on_gpt_cut_heads_rows_and_keep_the_function() -> None:
    g = GPT(tiny(), seed=0)  # 2 layers, 2 heads of 16, MLP 32 -> 128 -> 32
    cfg = _cfg(head_pruning=_tech({"num_heads": 2}, {"dense_ratio": 0.5}, [r"attn\.proj"], [[r"attn\.qkv"]]),
               row_pruning=_tech({"method": "l1"}, {"dense_ratio": 0.25}, [r"mlp\.fc"], [[r"mlp\.proj"]]),
               weight_quantization={"shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                                    "different_groups": {"w": {"params": {"start_bits": 8, "target_bits": 8},
                                                               "modules": [r"mlp\.proj"]}}})
    init_compression(g, cfg)
    CompressionScheduler(g, cfg["compression_training"]).step(step_zero_check=True)
    x = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        before, n0 = g(x)[0], _n(g)
    redundancy_clean(g, cfg)
    attn, mlp = g.blocks[0].attn, g.blocks[0].mlp
    assert tuple(attn.qkv.weight.shape) == (48, 32) and tuple(attn.qkv.bias.shape) == (48,)  # 3 x 1 head x 16
    assert tuple(attn.proj.weight.shape) == (32, 16)
    assert tuple(mlp.fc.weight.shape) == (32, 32) and tuple(mlp.proj.weight.shape) == (32, 32)
    q = mlp.proj.weight.detach()
    assert len(torch.unique(q[0])) <= 256  # stored quantized
    with torch.no_grad():
        torch.testing.assert_close(g(x)[0], before, rtol=1e-5, atol=1e-5)
    per_layer = 3 * 16 * 32 + 3 * 16 + 16 * 32 + 2 + 96 * 32 + 96 + 96 * 32  # qkv rows, proj cols, scores; rows
    assert n0 - _n(g) == 2 * per_layer


def test_channel_pruning_cuts_conv_filters_and_the_next_layers_channels() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))
    model.eval()
    cfg = _cfg(channel_pruning=_tech({"method": "l1"}, {"dense_ratio": 0.5}, ["^0$"], [["^1$", "^3$"]]))
    init_compression(model, cfg)
    CompressionScheduler(model, cfg["compression_training"]).step(step_zero_check=True)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        before = model(x)
    redundancy_clean(model, cfg)
    assert tuple(model[0].weight.shape) == (4, 3, 3, 3) and model[1].num_features == 4
    assert tuple(model[3].weight.shape) == (4, 4, 1, 1)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before)


def test_layer_reduction_from_a_teacher_and_in_place() -> None:
    teacher = GPT(tiny().__class__(block_size=32, n_layer=4, n_head=2, n_embd=32), seed=1)
    student = GPT(tiny(), seed=2)
    lr = {"enabled": True, "keep_number_layer": 2, "module_name_prefix": "blocks", "teacher_layer": [1, 3],
          "other_module_name": ["wte", "wpe", "ln_f"]}
    init_compression(student, _cfg(layer_reduction=lr), teacher_model=teacher)
    for s, t in ((student.blocks[0], teacher.blocks[1]), (student.blocks[1], teacher.blocks[3]),
                 (student.wte, teacher.wte), (student.ln_f, teacher.ln_f)):
        for ps, pt in zip(s.parameters(), t.parameters()):
            torch.testing.assert_close(ps, pt)
    alone = GPT(tiny().__class__(block_size=32, n_layer=4, n_head=2, n_embd=32), seed=1)
    init_compression(alone, _cfg(layer_reduction=lr))  # no teacher: the model keeps its own layers 1 and 3
    assert len(alone.blocks) == 2 and alone.blocks[1] is not None
    x = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(alone(x)[0], student(x)[0])


def test_deepspeed_import_paths() -> None:
    from zerospeed.compression.basic_layer import LinearLayer_Compress
    from zerospeed.compression.compress import init_compression as ic, redundancy_clean as rc
    from zerospeed.compression.helper import module_replacement, recursive_getattr
    from zerospeed.compression.utils import QuantSpec, topk_mask

    assert ic is init_compression and rc is redundancy_clean
    assert callable(module_replacement) and callable(recursive_getattr) and QuantSpec and topk_mask
    assert LinearLayer_Compress.__module__ == "zerospeed.compression.layers"
