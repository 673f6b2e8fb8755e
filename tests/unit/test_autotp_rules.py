"""AutoTP's placement rules (no processes): DeepSpeed's built-in rules, user specs (first match wins), presets,
and an error naming every layer the rules cannot place."""

import pytest
import torch
from torch import nn

from zerospeed.config import ConfigError, load_config
from zerospeed.parallel.tensor.autotp_config import AutoTPConfig, PartitionType, TPLayerSpec, resolve_partition_config
from zerospeed.parallel.tensor.policy import plan_model

tf = pytest.importorskip("transformers")
COL, ROW, SKIP = PartitionType.COLUMN, PartitionType.ROW, PartitionType.SKIP


def _kinds(plan):
    return {n: (p.kind, p.gather_output, p.shape) for n, p in plan.items()}


def _gpt2():
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8,
                                            bos_token_id=0, eos_token_id=0))


def _llama(tie=False):
    return tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=32,
                                              tie_word_embeddings=tie))


def test_gpt2_conv1d_rules() -> None:
    k = _kinds(plan_model(_gpt2()))
    assert k["transformer.h.0.attn.c_attn"] == (COL, False, (3, -1))  # fused q/k/v split per sub-matrix
    assert k["transformer.h.0.attn.c_proj"][0] == ROW  # last linear before ln_2
    assert k["transformer.h.0.mlp.c_fc"][0] == COL
    assert k["transformer.h.1.mlp.c_proj"][0] == ROW  # last of a pre-norm block: before the next block's ln_1
    assert k["lm_head"][0] == SKIP  # tied to wte: left whole (DeepSpeed's training fallback)


def test_zerospeed_gpt_rules() -> None:
    from zerospeed.models.gpt import GPT, tiny

    k = _kinds(plan_model(GPT(tiny())))
    assert k["blocks.0.attn.qkv"] == (COL, False, (3, -1))
    assert k["blocks.0.attn.proj"][0] == ROW and k["blocks.0.mlp.proj"][0] == ROW
    assert k["blocks.0.mlp.fc"][0] == COL and k["lm_head"][0] == SKIP


@pytest.mark.parametrize("make", [_llama, lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=32, tie_word_embeddings=False)), lambda: tf.MistralForCausalLM(tf.MistralConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=32))])
def test_llama_family_rules(make) -> None:
    k = _kinds(plan_model(make()))
    for leaf in ("q_proj", "k_proj", "v_proj"):
        assert k[f"model.layers.0.self_attn.{leaf}"][0] == COL
    assert k["model.layers.0.self_attn.o_proj"][0] == ROW
    assert k["model.layers.0.mlp.gate_proj"][0] == COL and k["model.layers.0.mlp.up_proj"][0] == COL
    assert k["model.layers.0.mlp.down_proj"][0] == ROW
    assert k["lm_head"] == (COL, True, None)  # untied head: column with a gathered output


def test_tied_llama_head_left_whole() -> None:
    assert plan_model(_llama(tie=True))["lm_head"].kind == SKIP


def test_mixtral_fused_experts_cannot_be_placed_unless_skipped() -> None:
    model = tf.MixtralForCausalLM(tf.MixtralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=32,
                                                   num_local_experts=2))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj .*shape \(2, 64, 16\)"):
        plan_model(model)
    cfg = AutoTPConfig(layer_specs=[TPLayerSpec([r".*\.experts\..*"], "skip")])
    plan = plan_model(model, cfg)
    assert plan["model.layers.0.self_attn.o_proj"].kind == ROW  # the built-in rules still place the rest


class _Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"gate": nn.Linear(8, 2), "q_a_proj": nn.Linear(8, 4),
                                                    "up": nn.Linear(8, 16), "down_proj": nn.Linear(16, 8)})])


def test_router_and_low_rank_left_whole() -> None:
    k = _kinds(plan_model(_Router()))
    assert k["layers.0.gate"][0] == SKIP and k["layers.0.q_a_proj"][0] == SKIP
    assert k["layers.0.up"][0] == COL and k["layers.0.down_proj"][0] == ROW


def test_user_regex_first_match_wins() -> None:
    cfg = resolve_partition_config(None, {"layer_specs": [
        {"patterns": [r".*\.q_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*_proj\.weight$"], "partition_type": "column"}]}, 2)
    k = _kinds(plan_model(_llama(), cfg))
    assert k["model.layers.0.self_attn.q_proj"][0] == ROW  # the first spec, although the second matches too
    assert k["model.layers.0.mlp.down_proj"][0] == COL  # user specs come before the built-in rules


def test_unmatched_layer_without_default_specs_is_an_error() -> None:
    cfg = resolve_partition_config(None, {"use_default_specs": False, "layer_specs": [
        {"patterns": [r".*\.(q|k|v)_proj\.weight$"], "partition_type": "column"}]}, 2)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj .*use_default_specs is false"):
        plan_model(_llama(), cfg)


def test_preset_and_merge_order() -> None:
    cfg = resolve_partition_config("llama", {"layer_specs": [{"patterns": [r".*o_proj\.weight$"],
                                                              "partition_type": "skip"}]}, 2)
    assert cfg.tp_size == 2 and cfg.layer_specs[0].partition_type == SKIP  # user's first, then the preset's
    assert cfg.find_matching_spec("model.layers.3.self_attn.o_proj.weight").partition_type == SKIP
    assert cfg.find_matching_spec("model.layers.3.mlp.down_proj.weight").partition_type == ROW
    with pytest.raises(ValueError, match="preset_model 'nope' is unknown"):
        resolve_partition_config("nope", None, 2)


def test_bad_specs_are_errors() -> None:
    with pytest.raises(ValueError, match="not a valid regular expression"):
        TPLayerSpec(["(unclosed"], "column")
    with pytest.raises(ValueError, match="nested tuple is allowed only at partition_dim"):
        TPLayerSpec([".*"], "column", shape=(3, (1, 2)), partition_dim=0)
    with pytest.raises(ValueError, match="gather_output applies to column"):
        TPLayerSpec([".*"], "row", gather_output=True)
    with pytest.raises(ValueError, match=r"unknown keys \['partition'\]"):
        AutoTPConfig.from_dict({"layer_specs": [{"patterns": ["x"], "partition": "row"}]})


class _Headed(nn.Module):
    def __init__(self, with_row: bool) -> None:
        super().__init__()
        block = nn.ModuleDict({"fc": nn.Linear(4, 8)})
        if with_row:
            block["out_proj"] = nn.Linear(8, 4)
        self.blocks = nn.ModuleList([block])
        self.score = nn.Linear(4, 2)


def test_layers_the_rules_cannot_place_are_named() -> None:
    with pytest.raises(ValueError, match=r"score \(Linear\): outside every repeated block"):
        plan_model(_Headed(with_row=True))
    with pytest.raises(ValueError, match=r"blocks\.0: column-parallel layers \['blocks\.0\.fc'\] but no row"):
        plan_model(_Headed(with_row=False), AutoTPConfig(layer_specs=[TPLayerSpec(["score"], "skip")]))


def test_config_section() -> None:
    cfg = load_config({"train_batch_size": 2, "tensor_parallel": {
        "autotp_size": 2, "tp": {"tp_size": 2, "tp_grain_size": 8}, "preset_model": "llama",
        "partition_config": {"use_default_specs": True, "layer_specs": []}}})
    assert cfg.tensor_parallel.size == 2 and cfg.tensor_parallel.tp.tp_grain_size == 8
    with pytest.raises(ConfigError, match="disagree"):
        load_config({"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}})
    with pytest.raises(ConfigError, match="keep_module_on_host: true is not supported yet"):
        load_config({"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2, "keep_module_on_host": True}})
    with pytest.raises(ConfigError, match="autotp_size"):
        load_config({"train_batch_size": 2, "tensor_parallel": {"autotp_sise": 2}})


def test_tp_model_init_request_merges_with_config() -> None:
    import zerospeed
    from zerospeed.config.tensor_parallel import TensorParallelConfig
    from zerospeed.parallel.tensor.model_init import merge_request

    model = zerospeed.tp_model_init(nn.Linear(2, 2), tp_size=2, dtype=torch.float32)
    merged, dtype, group = merge_request(model, TensorParallelConfig(preset_model="llama"))
    assert merged.size == 2 and merged.preset_model == "llama" and dtype == torch.float32 and group is None
    with pytest.raises(ValueError, match="autotp_size is 4 in the config but tp_model_init asked for 2"):
        merge_request(model, TensorParallelConfig(autotp_size=4))
