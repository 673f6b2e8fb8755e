"""Random-LTD's layer wrapper and the demo GPT's data-efficiency arguments (no processes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.config.data_efficiency import RandomLTDConfig
from zerospeed.data_pipeline import RandomLayerTokenDrop, RandomLTDScheduler, remove_random_ltd_state_dict
from zerospeed.data_pipeline.random_ltd import bert_sample_tokens, init_random_ltd_layers
from zerospeed.models.gpt import GPT, Block, tiny


class SeqFirst(nn.Module):
    """A batch-first block run on ``[seq, batch, hidden]`` tensors."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x.transpose(0, 1)).transpose(0, 1)


def _config(order: str = "batch_seq_dim", layers: int = 1, ids: list[int] | None = None) -> RandomLTDConfig:
    return RandomLTDConfig.parse_section({
        "enabled": True, "total_layer_num": 2, "random_ltd_layer_num": layers, "random_ltd_layer_id": ids or [0],
        "hidden_state_order": order,
        "random_ltd_schedule": {"min_value": 5, "max_value": 12, "schedule_config": {"require_steps": 4,
                                                                                     "seq_per_step": 1}}}, "ltd")


@pytest.mark.parametrize("order", ["batch_seq_dim", "seq_batch_dim"])
def test_kept_tokens_get_the_layers_output_and_dropped_ones_pass_through(order: str) -> None:
    torch.manual_seed(0)
    block = Block(tiny())  # causal attention mixes tokens: the output on the kept subset is not per-token
    cfg = _config(order)
    sched = RandomLTDScheduler(cfg, global_batch_size=3)
    wrapped = RandomLayerTokenDrop(block if order == "batch_seq_dim" else SeqFirst(block))
    wrapped.init_config(cfg, sched, 0)
    hidden = torch.randn(3, 12, 32, requires_grad=True)
    x = hidden if order == "batch_seq_dim" else hidden.transpose(0, 1)
    out = wrapped(x)
    out = out if order == "batch_seq_dim" else out.transpose(0, 1)
    idx = sched.state["sample_idx"][0].long()  # [batch, kept]
    assert idx.shape == (3, 5) and bool((idx[:, 1:] > idx[:, :-1]).all())  # sorted, distinct
    for b in range(3):
        kept = idx[b]
        dropped = torch.tensor([i for i in range(12) if i not in set(kept.tolist())])
        torch.testing.assert_close(out[b, kept], block(hidden[b:b + 1, kept])[0])
        assert torch.equal(out[b, dropped], hidden[b, dropped])
    # gradients: identity through the dropped tokens, through the layer for the kept ones
    out.sum().backward()
    grad = hidden.grad
    assert grad is not None
    ref = torch.zeros_like(hidden)
    for b in range(3):
        kept = idx[b]
        leaf = hidden[b:b + 1, kept].detach().requires_grad_(True)
        block(leaf).sum().backward()
        ref[b] = 1.0
        ref[b, kept] = leaf.grad[0]
    torch.testing.assert_close(grad, ref)


def test_full_length_eval_and_unconfigured_run_the_layer_unchanged() -> None:
    torch.manual_seed(0)
    block = Block(tiny())
    wrapped = RandomLayerTokenDrop(block)
    x = torch.randn(2, 12, 32)
    assert torch.equal(wrapped(x), block(x))  # not configured
    cfg = _config()
    sched = RandomLTDScheduler(cfg, global_batch_size=2)
    wrapped.init_config(cfg, sched, 0)
    wrapped.eval()
    assert torch.equal(wrapped(x), block(x))  # eval: all tokens
    wrapped.train()
    sched.set_current_seq(12)
    assert torch.equal(wrapped(x), block(x))  # reserved length >= sequence: all tokens


def test_encoder_mask_is_gathered_per_sample() -> None:
    mask = torch.arange(2 * 6 * 6, dtype=torch.float32).reshape(2, 1, 6, 6)
    idx, masks = bert_sample_tokens(3, 6, 2, layers=2, attn_mask=mask)
    for layer in range(2):
        for b in range(2):
            rows = idx[layer, b]
            assert torch.equal(masks[layer][b, 0], mask[b, 0][rows][:, rows])


def test_layer_selection_by_id_and_state_dict_names() -> None:
    model = GPT(tiny())
    for i in range(2):
        model.blocks[i] = RandomLayerTokenDrop(model.blocks[i])
    cfg = _config(ids=[1])
    sched = RandomLTDScheduler(cfg, global_batch_size=2)
    assert init_random_ltd_layers(model, cfg, sched) == 1
    assert model.blocks[0].random_ltd_scheduler is None and model.blocks[1].random_ltd_layer_id == 0
    with pytest.raises(ValueError, match="random_ltd_layer_num 2"):
        init_random_ltd_layers(model, _config(layers=2, ids=[1]), sched)
    plain = remove_random_ltd_state_dict(model.state_dict())
    assert set(plain) == set(GPT(tiny()).state_dict())


def test_gpt_curriculum_seqlen_truncates_inputs_and_targets() -> None:
    model = GPT(tiny(), seed=1)
    idx = torch.randint(0, 256, (2, 16))
    tgt = torch.randint(0, 256, (2, 16))
    logits, loss = model(idx, tgt, curriculum_seqlen=8)
    ref_logits, ref_loss = model(idx[:, :8], tgt[:, :8])
    assert logits is not None and logits.shape[1] == 8
    assert torch.equal(loss, ref_loss) and torch.equal(logits, ref_logits)
    _, full = model(idx, tgt, curriculum_seqlen=32)  # longer than the batch: no change
    assert torch.equal(full, model(idx, tgt)[1])


def test_gpt_progressive_layer_drop_is_stochastic_depth_in_training_only() -> None:
    cfg = tiny()
    model = GPT(cfg, seed=1)
    idx = torch.randint(0, 256, (2, 16))
    base = model(idx)[0]
    assert torch.equal(model(idx, progressive_layer_drop=True, pld_theta=1.0)[0], base)  # keep everything
    calls: list[int] = []
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda m, a, o, i=i: calls.append(i))
    torch.manual_seed(0)
    for _ in range(200):
        model(idx, progressive_layer_drop=True, pld_theta=0.0)
    # block 0 always runs; block 1 runs with probability 1 - 1 * (1 - 0) / 2 = 0.5
    assert calls.count(0) == 200 and 60 < calls.count(1) < 140
    model.eval()
    assert torch.equal(model(idx, progressive_layer_drop=True, pld_theta=0.0)[0], base)


def test_convert_needs_the_engine_and_leaves_a_plain_model_alone() -> None:
    from zerospeed.data_pipeline import convert_to_random_ltd

    model = GPT(tiny())
    with pytest.raises(ValueError, match="needs the engine"):
        convert_to_random_ltd(model, Block)
    assert not any(isinstance(m, RandomLayerTokenDrop) for m in model.modules())
