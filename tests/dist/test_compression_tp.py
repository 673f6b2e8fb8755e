"""Compression under AutoTP (issue 35 item 5): tp 2 at world 2 trains exactly as one process applying the same
per-shard rule (``compression/tensor_parallel.py``): 4-bit weights with two groups per shard, dynamic 8-bit
activations on a column-parallel layer, learned row pruning (each shard keeps half its rows), l1 sparsity of a
row-parallel layer's shard, and learned head pruning of the attention output (each rank keeps one of its 2 heads).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from zerospeed.testing import run_distributed

from .tp_fixtures import engine_config, global_batch, loss_of, make_model

TP, STEPS, BATCH = 2, 3, 4
COMPRESSION = {
    "weight_quantization": {"shared_parameters": {"enabled": True, "quantize_weight_in_forward": True,
                                                  "quantize_groups": 2, "schedule_offset": 0},
                            "different_groups": {"w": {"params": {"start_bits": 4, "target_bits": 4},
                                                       "modules": ["mlp.fc", "mlp.proj", "attn.proj"]}}},
    "activation_quantization": {"shared_parameters": {"enabled": True, "schedule_offset": 0},
                                "different_groups": {"a": {"params": {"bits": 8}, "modules": ["mlp.fc"]}}},
    "row_pruning": {"shared_parameters": {"enabled": True, "method": "topk", "schedule_offset": 1},
                    "different_groups": {"r": {"params": {"dense_ratio": 0.5}, "modules": ["mlp.fc"]}}},
    "sparse_pruning": {"shared_parameters": {"enabled": True, "method": "l1", "schedule_offset": 1},
                       "different_groups": {"s": {"params": {"dense_ratio": 0.5}, "modules": ["mlp.proj"]}}},
    "head_pruning": {"shared_parameters": {"enabled": True, "schedule_offset": 2, "num_heads": 4},
                     "different_groups": {"h": {"params": {"dense_ratio": 0.5}, "modules": ["attn.proj"]}}}}


def _per_shard(layer: Any, cut: int) -> None:
    """Make one process's ``LinearLayer_Compress`` apply the tensor-parallel rule to each of its TP slices."""
    from zerospeed.compression import masks
    from zerospeed.compression.quantizers import QuantSpec, fake_quant

    if layer.sparse_pruning_method == "l1":  # each slice's own top half by |w|, from the initial weights
        layer.sparse_pruning_mask = torch.cat([masks.topk_mask(w.abs(), 0.5) for w in layer.weight.detach().chunk(TP, cut)], cut)

    def weight_and_bias(self: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        pieces, bias = [], self.bias
        for r, w in enumerate(self.weight.chunk(TP, cut)):
            w = fake_quant(w, QuantSpec(4, True, 2)) if self.weight_quantization_enabled else w
            if self.sparse_pruning_enabled:
                w = w * self.sparse_pruning_mask.chunk(TP, cut)[r]
            if self.row_pruning_enabled and self.row_pruning_method:
                w = w * masks.learned_mask(self.row_mask_scores.chunk(TP, 0)[r], 0.5)
            if self.head_pruning_enabled and self.head_pruning_method:
                mask = masks.learned_mask(self.head_pruning_scores.chunk(TP, 1)[r], 0.5)
                w = masks.head_mask_columns(w, mask, self.num_heads // TP)
            pieces.append(w)
        if self.row_pruning_enabled and self.row_pruning_method and bias is not None:
            rows = torch.cat([masks.learned_mask(s, 0.5) for s in self.row_mask_scores.chunk(TP, 0)])
            bias = bias * rows.reshape(-1)
        return torch.cat(pieces, cut), bias

    layer.compressed_weight_and_bias = types.MethodType(weight_and_bias, layer)


def train(tp: int, ckpt: str = "") -> dict[str, Any]:
    """``STEPS`` steps; with ``ckpt`` saved after step 2 and resumed there by a fresh engine."""
    import zerospeed
    from zerospeed.compression import init_compression

    config = engine_config(tp, 0, BATCH, 0.0, {"compression_training": COMPRESSION})
    if tp == 1:
        del config["tensor_parallel"]

    def engine_() -> Any:
        model = init_compression(make_model("gpt"), config)
        if tp == 1:
            for block in model.blocks:
                _per_shard(block.mlp.fc, 0), _per_shard(block.mlp.proj, 1), _per_shard(block.attn.proj, 1)
        return zerospeed.initialize(model=model, config=config)[0]

    def steps(engine: Any, which: range) -> list[float]:
        losses = []
        for step in which:
            loss = loss_of("gpt", engine, global_batch(step, BATCH))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    engine = engine_()
    losses = steps(engine, range(2))
    if ckpt:
        engine.save_checkpoint(ckpt, tag="s2")
    losses += steps(engine, range(2, STEPS))
    resumed = []
    if ckpt:
        fresh = engine_()
        fresh.load_checkpoint(ckpt, tag="s2")
        resumed = steps(fresh, range(2, STEPS))
    block = engine.module.blocks[0]
    kinds = [type(m).__name__ for m in (block.mlp.fc, block.mlp.proj, block.attn.proj, block.attn.qkv)]
    return {"losses": losses, "resumed": resumed, "kinds": kinds, "heads": block.attn.proj.num_heads,
            "kept_rows": int(block.mlp.fc.get_mask("row").sum()), "rows": block.mlp.fc.out_features}


def test_compression_under_autotp_equals_one_process_applying_the_per_shard_rule(tmp_path: Any) -> None:
    """...and a tp 2 checkpoint saved at step 2 resumes exactly (sliced learned scores, rebuilt l1 masks)."""
    one = run_distributed(train, 1, 1, timeout=120)[0]
    for r in run_distributed(train, 2, TP, str(tmp_path), timeout=120):
        assert r["resumed"] == r["losses"][2:]
        assert r["kinds"] == ["ColumnParallelLinear_Compress", "RowParallelLinear_Compress",
                              "RowParallelLinear_Compress", "SubParamLinearLayer"]
        assert (r["heads"], r["kept_rows"], r["rows"]) == (2, 32, 64)  # 2 of 4 heads; half of 64 local rows
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    assert len(set(one["losses"])) == STEPS
