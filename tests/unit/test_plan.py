"""``zerospeed plan``: activation formulas against autograd's saved tensors, buffer rules by hand, the CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from zerospeed.config import load_config
from zerospeed.launcher import cli
from zerospeed.models.gpt import GPT, GPTConfig
from zerospeed.profiling.plan import FRAMEWORK_BYTES, PlanInputs, inputs_from_config, predict
from zerospeed.profiling.plan_models import (ModelSpec, Shape, gpt_activation_bytes, hf_gpt2_activation_bytes,
                                             model_spec)


def _saved_bytes(model: torch.nn.Module, run) -> int:
    """Bytes of distinct storages autograd saves for backward, parameters and inputs excluded."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


@pytest.mark.parametrize("c,layers,heads,vocab,b,t", [(32, 2, 2, 256, 2, 16), (48, 3, 4, 128, 3, 8)])
def test_gpt_activation_formula_matches_saved_tensors(c: int, layers: int, heads: int, vocab: int, b: int,
                                                      t: int) -> None:
    model = GPT(GPTConfig(vocab_size=vocab, block_size=32, n_layer=layers, n_head=heads, n_embd=c))
    x = torch.randint(0, vocab, (b, t))
    measured = _saved_bytes(model, lambda: model(x, x))
    measured -= x.untyped_storage().nbytes()  # targets are inputs, not activations
    assert gpt_activation_bytes(Shape(layers, c, heads, vocab, 32), b, t, 4) == measured


def test_hf_gpt2_activation_formula_matches_saved_tensors() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).train()
    x = torch.randint(0, 128, (3, 8))
    measured = _saved_bytes(model, lambda: model(input_ids=x, labels=x))
    measured -= x.untyped_storage().nbytes()  # the token ids are inputs, not activations
    assert hf_gpt2_activation_bytes(Shape(2, 32, 4, 128, 32), 3, 8, 4) == measured


def test_meta_spec_counts_parameters_like_the_real_model() -> None:
    from zerospeed.models.gpt import demo

    spec = model_spec("gpt:demo")
    assert spec.numels == tuple(p.numel() for p in GPT(demo()).parameters())  # tied head counted once
    assert spec.shape.n_layer == 4 and spec.shape.max_seq == 128
    with pytest.raises(ValueError, match="exceeds"):
        spec.activations(1, 129, 4)
    with pytest.raises(ValueError, match="expected gpt"):
        model_spec("llama:7b")


SPEC = ModelSpec("toy", (10, 7), (True, True), Shape(1, 4, 1, 8, 16), lambda s, b, t, e: 1000, 1.0)
BASE = PlanInputs(stage=0, world=2, micro_batch=1, seq=4, compute_bytes=4, accum_bytes=4, reduce_bucket=10**9,
                  allgather_bucket=10**9, prefetch=10**9, max_live=10**9, max_reuse=10**9, param_persistence=0,
                  model_persistence=2**63 - 1, optimizer="adamw")


@pytest.mark.parametrize("stage,expected", [
    # params, grads, master, optimizer_state, buckets, gathered_params (shards of 10 and 7 over 2 ranks: 5 + 4)
    # AdamW's step makes two temporaries the size of the largest master tensor: 2 x 10 (stage 0), 2 x 5 (shards)
    (0, (68, 68, 0, 136, 80, 0)),  # one partition: the fp32 model is its own master; full gradient buffer
    # stage 1: full padded gradients; at the end of backward and the step: partition, reduce-scatter output (the
    # write-back gathers in place on Gloo host tensors: no buffer)
    (1, (68, 72, 36, 72, 36 + 36 + 40, 0)),
    (2, (68, 36, 36, 72, 72 + 36 + 40, 0)),  # gradient partition; one bucket + reduce-scatter output; write-back
    # stage 3: fp32 shards are the master; gathered + the heap holes of the gathered (Gloo host tensors: the
    # gathers are in place into the parameters' own buffers, no staging output)
    (3, (0, 36, 36, 72, 72 + 36 + 40, 4 * (18 + 18))),
])
def test_buffer_rules_by_hand(stage: int, expected: tuple[int, ...]) -> None:
    plan = predict(SPEC, replace(BASE, stage=stage))
    owners = ("params", "grads", "master", "optimizer_state", "buckets", "gathered_params")
    assert tuple(plan.owners[k] for k in owners) == expected
    assert plan.owners["activations"] == 1000 and plan.owners["framework"] == FRAMEWORK_BYTES
    assert plan.peak_over_start == sum(expected) + 1000 + FRAMEWORK_BYTES
    assert plan.absolute == plan.peak_over_start + plan.baseline_bytes


def test_stage3_persistent_parameters_stay_whole_and_bf16_shards_cost_their_bytes() -> None:
    plan = predict(SPEC, replace(BASE, stage=3, param_persistence=8))  # 7 stays whole, 10 is cut
    assert plan.owners["params"] == 7 * 4 and plan.owners["gathered_params"] == 4 * (10 + 10)
    staged = predict(SPEC, replace(BASE, stage=3, param_persistence=8, staged_gathers=True))  # qwZ / hpZ
    assert staged.owners["gathered_params"] == 4 * (10 + 10 + 10)  # + the gather's staging output
    half = predict(SPEC, replace(BASE, stage=3, compute_bytes=2))
    assert half.owners["params"] == 9 * 2 and half.owners["master"] == 36
    small_live = predict(SPEC, replace(BASE, stage=3, max_live=1, prefetch=0))
    assert small_live.owners["gathered_params"] == 4 * (10 + 18)  # the largest unit (+ holes), not the whole model


M = 1_000_000
BIG = ModelSpec("big", (16 * M, 4 * M, 4 * M, 4 * M), (True,) * 4, Shape(1, 4, 1, 8, 16),
                lambda s, b, t, e: 400 * M, 1.0)  # fp32: units of 64 and 16 MB, 400 MB of saved activations


@pytest.mark.parametrize("reuse,prefetch,expected", [
    # + 12M everywhere: the heap holes the three 16 MB units leave (gathered and freed every step)
    (10**9, 5 * 10**7, 28 * M + 12 * M),  # DeepSpeed's defaults: all kept from forward to backward (mapped gather)
    (0, 6 * M, (16 + 6) * M + 12 * M),  # the largest unit and the prefetch window (the gather's output is mapped)
    (8 * M, 6 * M, (4 + 16 + 6) * M + 12 * M),  # the last reuse/2 elements kept, the rest gathered again
    # a reuse distance covering forward's rest and backward down to the first unit: all kept
    (56 * M, 6 * M, 28 * M + 12 * M),
])
def test_stage3_gathered_parameters_follow_the_reuse_distance(reuse: int, prefetch: int, expected: int) -> None:
    plan = predict(BIG, replace(BASE, stage=3, max_reuse=reuse, prefetch=prefetch))
    assert plan.owners["gathered_params"] == 4 * expected


def test_mapped_bucket_buffers_take_the_place_of_freed_activations() -> None:
    # stage 2, one bucket per parameter (each above the cap, 1/8 of the model): the three largest (64, 16, 16 MB)
    # and two reduce-scatter outputs (32, 8 MB) in flight; only the 64 MB one is mmapped (32 MB < 32 MiB: heap)
    sizes = [64 * M, 16 * M, 16 * M, 32 * M, 8 * M]
    heap = sum(b for b in sizes if b < 32 * 1024 * 1024)
    with_acts = predict(BIG, replace(BASE, stage=2, allgather_bucket=1))
    step = 2 * 32 * M  # AdamW's two temporaries (the write-back gathers in place)
    assert with_acts.owners["buckets"] == heap + step
    no_acts = predict(replace(BIG, activation_bytes=lambda s, b, t, e: 0), replace(BASE, stage=2, allgather_bucket=1))
    assert no_acts.owners["buckets"] == sum(sizes) + step  # nothing freed to take the place of


def test_stage3_peaks_before_a_mapped_gradient_partition_is_made_again() -> None:
    assert predict(BIG, replace(BASE, stage=3)).owners["grads"] == 0  # 14M fp32 elements: mapped, made in backward
    assert predict(BIG, replace(BASE, stage=2)).owners["grads"] == 4 * 14 * M  # held at stage 2's step peak
    assert predict(SPEC, replace(BASE, stage=3)).owners["grads"] == 36  # heap-sized: it adds


def test_adam_step_temporaries_follow_the_largest_master_tensor() -> None:
    adamw = predict(BIG, replace(BASE, stage=0)).owners["buckets"]
    assert adamw == 2 * 16 * M * 4  # stage 0: the 16M parameter itself
    assert predict(BIG, replace(BASE, stage=0, optimizer="sgd")).owners["buckets"] == 0
    assert predict(BIG, replace(BASE, stage=0, offload_optimizer=True)).owners["buckets"] == 0  # not torch's step


def test_inputs_from_config() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True},
                       "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                       "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}})
    i = inputs_from_config(cfg, 2)
    assert (i.stage, i.micro_batch, i.compute_bytes, i.accum_bytes, i.reduce_bucket) == (2, 4, 2, 2, 1000)
    assert predict(SPEC, replace(i, seq=4)).owners["optimizer_state"] == 0  # SGD without momentum keeps no state
    assert inputs_from_config(cfg, 2, micro_batch=3, stage=1).stage == 1
    nvme = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})
    with pytest.raises(ValueError, match="NVMe offload is not supported yet"):
        inputs_from_config(nvme, 2)


def test_cli_prints_table_and_json(tmp_path, capsys) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    assert cli.main(["plan", str(path), "--model", "gpt:tiny", "--world-size", "2", "--seq", "16",
                     "--baseline-mib", "100"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage 2, world 2, micro-batch 2, seq 16" in out and "optimizer_state" in out
    record = json.loads(out.strip().splitlines()[-1])
    assert record["stage"] == 2 and record["baseline_bytes"] == 100 * 1024 * 1024
    assert record["absolute_bytes"] == record["peak_over_start_bytes"] + record["baseline_bytes"]
    assert cli.main(["plan", str(path), "--model", "gpt:nope"]) == 2
    assert "unknown GPT preset" in capsys.readouterr().err
