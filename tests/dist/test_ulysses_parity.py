"""Ulysses sequence parallelism trains like one process: zerospeed's GPT at sp=2 (world 2) and sp=2 x dp=2
(world 4) under ZeRO 1, 2 and 3 gives the unsharded run's losses and gradient norms (fp32, rtol 1e-5)."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from zerospeed import comm
from zerospeed.models.gpt import GPT, GPTConfig
from zerospeed.parallel.sequence.gpt import sequence_parallel_gpt
from zerospeed.testing import run_distributed

STEPS, MB, SEQ, LR, CLIP = 10, 2, 8, 1e-2, 1.0
CFG = GPTConfig(vocab_size=32, block_size=SEQ, n_layer=2, n_head=4, n_embd=16)


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, CFG.vocab_size, (n, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _reference(dp: int, gas: int = 1, steps: int = STEPS) -> tuple[list[float], list[float]]:
    model = GPT(CFG, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for step in range(steps):
        x, y = _batch(step, MB * dp * gas)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(loss.item())
    return losses, norms


def _train(stage: int, sp: int, gas: int = 1, zero_extra: dict | None = None, extra: dict | None = None,
           steps: int = STEPS) -> dict:
    model = GPT(CFG, seed=3)
    config = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
              "sequence_parallel_size": sp, "zero_optimization": {"stage": stage, **(zero_extra or {})},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}, **(extra or {})}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    sequence_parallel_gpt(model, engine.seq_parallel_group)
    dp, d = engine.dp_world_size, engine.get_data_parallel_rank()
    r = comm.get_rank(engine.seq_parallel_group)
    chunk = SEQ // sp
    losses, norms = [], []
    cols, pos = slice(r * chunk, (r + 1) * chunk), torch.arange(r * chunk, (r + 1) * chunk)
    for step in range(steps):
        x, y = _batch(step, MB * dp * gas)
        total = torch.zeros(())
        for micro in range(gas):  # micro-batch ``micro`` of data replica d: rows as a data-parallel loader gives
            rows = slice((micro * dp + d) * MB, (micro * dp + d + 1) * MB)
            _, loss = engine(x[rows, cols], y[rows, cols], position_ids=pos)
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        comm.all_reduce(total)  # every rank's shard holds the same number of tokens
        losses.append(total.item() / comm.get_world_size() / gas)
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms, "dp": dp, "train_batch": engine.train_batch_size() // gas,
            "comm_dtype": str(engine.optimizer.reducer.s.comm_dtype),
            "sp_size": comm.get_world_size(engine.seq_parallel_group)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gpt_ulysses_matches_one_process(stage: int, world: int) -> None:
    dp = world // 2
    ref_losses, ref_norms = _reference(dp)
    for r in run_distributed(_train, world, stage, 2, timeout=180):
        assert (r["dp"], r["train_batch"], r["sp_size"]) == (dp, MB * dp, 2)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [2, 3])
def test_gpt_ulysses_with_accumulation_and_cpu_offload(stage: int) -> None:
    ref_losses, ref_norms = _reference(2, gas=2)
    offload = {"offload_optimizer": {"device": "cpu"}}
    for r in run_distributed(_train, 4, stage, 2, 2, offload, timeout=180):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)


def _both_dtypes(stage: int) -> list[dict]:
    """sp=2: gradients reduced in bf16 (DeepSpeed's seq_parallel_communication_data_type), then the fp32 default
    with a bf16 communication_data_type that sequence parallelism replaces (as in DeepSpeed)."""
    return [_train(stage, 2, extra={"seq_parallel_communication_data_type": "bf16"}, steps=3),
            _train(stage, 2, extra={"communication_data_type": "bf16"}, steps=3)]


def test_seq_parallel_communication_data_type_is_the_gradient_dtype_under_sequence_parallelism() -> None:
    ref_losses, _ = _reference(1, steps=3)
    for bf16, fp32 in run_distributed(_both_dtypes, 2, 2, timeout=180):
        assert (bf16["comm_dtype"], fp32["comm_dtype"]) == ("torch.bfloat16", "torch.float32")
        torch.testing.assert_close(torch.tensor(fp32["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(bf16["losses"]), torch.tensor(ref_losses), rtol=2e-2, atol=0)
        assert bf16["losses"] != fp32["losses"]


def _resume(stage: int, path: str) -> tuple[list[float], list[float]]:
    """Four steps straight, and two steps + save + a new engine that loads and runs two more."""
    import os

    def engine_and_loop(model: GPT):
        config = {"train_micro_batch_size_per_gpu": MB, "sequence_parallel_size": 2, "zero_optimization":
                  {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}
        engine, *_ = zerospeed.initialize(model=model, config=config)
        sequence_parallel_gpt(model, engine.seq_parallel_group)
        r, chunk = comm.get_rank(engine.seq_parallel_group), SEQ // 2
        cols, pos = slice(r * chunk, (r + 1) * chunk), torch.arange(r * chunk, (r + 1) * chunk)

        def run(steps: range) -> list[float]:
            out = []
            for step in steps:
                x, y = _batch(step, MB)
                _, loss = engine(x[:, cols], y[:, cols], position_ids=pos)
                engine.backward(loss)
                engine.step()
                out.append(loss.item())
            return out
        return engine, run

    _, run = engine_and_loop(GPT(CFG, seed=3))
    straight = run(range(4))
    engine, run = engine_and_loop(GPT(CFG, seed=3))
    resumed = run(range(2))
    engine.save_checkpoint(os.path.join(path, "ckpt"), tag="t")
    engine, run = engine_and_loop(GPT(CFG, seed=9))  # other weights: the load must restore them
    engine.load_checkpoint(os.path.join(path, "ckpt"), tag="t")
    return straight, resumed + run(range(2, 4))


@pytest.mark.parametrize("stage", [2, 3])
def test_gpt_ulysses_checkpoint_resume(stage: int, tmp_path) -> None:
    for straight, resumed in run_distributed(_resume, 2, stage, str(tmp_path), timeout=180):
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight), rtol=1e-6, atol=1e-7)
