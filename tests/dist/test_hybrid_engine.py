"""The hybrid engine (DeepSpeed-Chat's step 3) on a tiny GPT-2 at world 2: greedy rollouts equal HF generate on the
gathered weights at ZeRO 0-3; the stage-3 weights are gathered once per rollout phase (no all-gather while
tokens are produced; with ``pin_parameters: false``, gathered per forward instead); a training step after a rollout
equals one without; actor / critic / reference / reward engines live in one process with separate state."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import zerospeed
from zerospeed import comm
from zerospeed.testing import run_distributed

VOCAB, MB = 48, 2


def _gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                     eos_token_id=VOCAB + 1, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _config(stage: int, hybrid: bool = True, release: bool = False, optimizer: bool = True, pin: bool = True) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
           "hybrid_engine": {"enabled": hybrid, "max_out_tokens": 16, "release_inference_cache": release,
                             "pin_parameters": pin}}
    if optimizer:
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 0.01}}
    return cfg


def _ids(step: int, rank: int, n: int = 6) -> torch.Tensor:
    return torch.randint(1, VOCAB, (MB, n), generator=torch.Generator().manual_seed(100 * step + rank))


def _train_step(engine, step: int) -> float:
    ids = _ids(step, comm.get_rank(), 10)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return float(loss)


def _gathers(engine) -> int:
    return sum(s.count for op, s in engine.comms.snapshot().items() if "gather" in op)


def _oracle(engine) -> GPT2LMHeadModel:
    """HF's model on the engine's gathered weights (eval mode)."""
    oracle = _gpt2().eval()
    with zerospeed.zero.GatheredParameters(list(engine.module.parameters())), torch.no_grad():
        for mine, theirs in zip(oracle.parameters(), engine.module.parameters()):
            mine.copy_(theirs)
    return oracle


def _rollouts(stage: int) -> tuple:
    """One step, a rollout phase of two generate() calls, one more step; beside it the same engine without
    rollouts (training after a rollout must equal training without)."""
    with_roll, _, _, _ = zerospeed.initialize(model=_gpt2(), config=_config(stage))
    plain = zerospeed.initialize(model=_gpt2(), config=_config(stage, hybrid=False))[0]
    losses = [_train_step(e, 0) for e in (with_roll, plain)]
    oracle = _oracle(with_roll)
    with_roll.eval()
    gathers = []
    for call in range(2):
        prompt = _ids(50 + call, comm.get_rank())
        before = _gathers(with_roll)
        out = with_roll.generate(prompt, max_new_tokens=8, do_sample=False)
        gathers.append(_gathers(with_roll) - before)
        assert torch.equal(out, oracle.generate(prompt, max_new_tokens=8, do_sample=False)), (stage, call)
    assert with_roll.module.training is False
    with_roll.train()
    assert with_roll.module.training and not with_roll.parts.hybrid.in_phase
    losses += [_train_step(e, 1) for e in (with_roll, plain)]
    both = list(with_roll.module.parameters()) + list(plain.module.parameters())
    with zerospeed.zero.GatheredParameters(both):
        same = all(torch.equal(a, b) for a, b in zip(with_roll.module.parameters(), plain.module.parameters()))
    return losses, gathers, same, with_roll.parts.hybrid.gathers


def _all_stages() -> list:
    return [_rollouts(stage) for stage in range(4)]


def test_rollouts_equal_hf_generate_and_leave_training_alone() -> None:
    for rank_result in run_distributed(_all_stages, 2, timeout=240):
        for stage, (losses, gathers, same, phase_gathers) in enumerate(rank_result):
            assert losses[0] == losses[1] and losses[2] == losses[3] and same, (stage, losses)  # no state changed
            if stage == 3:  # gathered once when the phase began, held for the second call: no gather at all
                assert phase_gathers == 1 and gathers[0] > 0 and gathers[1] == 0, gathers
            else:
                assert gathers == [0, 0] and phase_gathers == 0, (stage, gathers)


def _unpinned() -> tuple:
    """``pin_parameters: false`` at stage 3: no phase-long gather; every forward gathers per module, as training."""
    engine = zerospeed.initialize(model=_gpt2(), config=_config(3, pin=False))[0]
    _train_step(engine, 0)
    oracle = _oracle(engine)
    engine.eval()
    prompt = _ids(50, comm.get_rank())
    before = _gathers(engine)
    out = engine.generate(prompt, max_new_tokens=8, do_sample=False)
    equal = torch.equal(out, oracle.generate(prompt, max_new_tokens=8, do_sample=False))
    return equal, engine.parts.hybrid.gathers, _gathers(engine) - before


def test_pin_parameters_false_gathers_per_forward() -> None:
    for equal, phase_gathers, gathers in run_distributed(_unpinned, 2, timeout=120):
        assert equal and phase_gathers == 0 and gathers >= 8, gathers  # at least one gather per generated token


def _four_engines() -> tuple:
    """DeepSpeed-Chat's four models: actor (ZeRO-3, hybrid), critic (ZeRO-2), frozen reference (ZeRO-3, no
    optimizer), reward (ZeRO-0, no optimizer); one PPO-style step each for the actor and the critic."""
    actor, *_ = zerospeed.initialize(model=_gpt2(0), config=_config(3, release=True))
    critic, *_ = zerospeed.initialize(model=_gpt2(1), config=_config(2, hybrid=False))
    ref_model = _gpt2(0).requires_grad_(False)
    ref, *_ = zerospeed.initialize(model=ref_model, config=_config(3, hybrid=False, optimizer=False))
    reward, *_ = zerospeed.initialize(model=_gpt2(2).requires_grad_(False), config=_config(0, False, optimizer=False))
    with zerospeed.zero.GatheredParameters(list(ref.module.parameters())):
        ref_before = [p.detach().clone() for p in ref.module.parameters()]
    actor.eval()
    seq = actor.generate(_ids(0, comm.get_rank()), max_new_tokens=6, do_sample=False)
    released = not actor.parts.hybrid.in_phase  # release_inference_cache: weights and cache given back at once
    actor.train()
    with torch.no_grad():
        ref_logp = torch.log_softmax(ref(input_ids=seq).logits, -1)
        score = reward(input_ids=seq).logits[:, -1, 0]
    logp = torch.log_softmax(actor(input_ids=seq).logits, -1)
    actor_loss = -(score.unsqueeze(-1) * (logp - ref_logp).gather(-1, seq.unsqueeze(-1)).squeeze(-1)).mean()
    actor.backward(actor_loss)
    actor.step()
    value = critic(input_ids=seq).logits[:, :, 0]
    critic_loss = ((value - score.unsqueeze(-1)) ** 2).mean()
    critic.backward(critic_loss)
    critic.step()
    with zerospeed.zero.GatheredParameters(list(ref.module.parameters())):
        ref_same = all(torch.equal(a, b) for a, b in zip(ref_before, ref.module.parameters()))
    return (actor.global_steps, critic.global_steps, ref.optimizer is None, ref_same,
            actor.comms is not critic.comms, _gathers(ref) > 0, released)


def test_actor_critic_reference_reward_in_one_process() -> None:
    for result in run_distributed(_four_engines, 2, timeout=240):
        assert result == (1, 1, True, True, True, True, True)
