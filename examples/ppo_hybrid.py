"""A compact PPO loop in DeepSpeed-Chat's shape (step 3, RLHF) on the hybrid engine — CPU, well under two minutes.

    python examples/ppo_hybrid.py                # or: zerospeed launch --nproc-per-node 2 examples/ppo_hybrid.py

Four engines in one process, as DeepSpeed-Chat's ``DeepSpeedRLHFEngine``: the *actor* (a tiny GPT-2 built from a
config, ZeRO-3, ``hybrid_engine`` on: ``actor.eval()`` / ``actor.generate()`` / ``actor.train()``), the frozen
*reference* (the actor's initial weights, ZeRO-3, no optimizer), the *critic* (a GPT-2 body with a value head,
ZeRO-2) and the *reward* (here a rule with a known answer instead of a learned model: the share of generated
tokens equal to ``--target``; the best policy scores 1.0, a random one about 1/vocab). Each iteration:
rollouts from the actor, log-probs under actor and reference, values from the critic, per-token rewards
(KL penalty + the final score), GAE advantages, then one clipped-PPO update of the actor and one of the critic.
The printed mean reward rises towards 1.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

import zerospeed
from zerospeed import comm

VOCAB = 16


def gpt2_config() -> GPT2Config:
    return GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                      eos_token_id=None, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


class Critic(nn.Module):
    """DeepSpeed-Chat's critic shape: a transformer body and a scalar value head per position."""

    def __init__(self) -> None:
        super().__init__()
        self.body = GPT2Model(gpt2_config())
        self.v_head = nn.Linear(32, 1, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.v_head(self.body(input_ids=input_ids).last_hidden_state).squeeze(-1)


def ds_config(stage: int, lr: float | None, hybrid: bool, batch: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": batch, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage},
           "hybrid_engine": {"enabled": hybrid, "max_out_tokens": 32, "release_inference_cache": False,
                             "pin_parameters": True}}
    if lr is not None:
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": lr}}
    return cfg


def token_logprobs(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """log p(seq[t+1] | seq[:t+1]) for every t."""
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, seq[:, 1:].unsqueeze(-1)).squeeze(-1)


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 0.95) -> torch.Tensor:
    adv, last = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        nxt = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(last)
        last = rewards[:, t] + gamma * nxt - values[:, t] + gamma * lam * last
        adv[:, t] = last
    return adv


def ppo(iters: int = 40, batch: int = 16, prompt: int = 4, new: int = 8, target: int = 7, kl: float = 0.02,
        lr: float = 3e-3, log_every: int = 5) -> list[float]:
    """Train for ``iters`` PPO iterations; this rank's mean reward of each iteration's rollouts (rank 0 prints a
    line every ``log_every`` iterations; 0: silent). Called in-process by ``tests/dist/test_ppo_example.py``."""
    torch.manual_seed(0)
    actor_model = GPT2LMHeadModel(gpt2_config())
    ref_model = GPT2LMHeadModel(gpt2_config())
    ref_model.load_state_dict(actor_model.state_dict())
    actor, *_ = zerospeed.initialize(model=actor_model, config=ds_config(3, lr, True, batch))
    ref, *_ = zerospeed.initialize(model=ref_model.requires_grad_(False), config=ds_config(3, None, False, batch))
    critic, *_ = zerospeed.initialize(model=Critic(), config=ds_config(2, lr, False, batch))
    rank, rewards = comm.get_rank(), []
    torch.manual_seed(1 + rank)  # each rank samples its own prompts and rollouts
    for it in range(iters):
        prompts = torch.randint(1, VOCAB, (batch, prompt))
        actor.eval()  # a rollout phase: ZeRO-3 weights gathered once, KV cache for the phase
        seq = actor.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                             do_sample=True, top_k=0)
        actor.train()
        gen = seq[:, prompt:]
        score = (gen == target).float().mean(1)  # the reward "model": a rule with a known optimum
        with torch.no_grad():
            old_logp = token_logprobs(actor(input_ids=seq).logits, seq)[:, prompt - 1:]
            ref_logp = token_logprobs(ref(input_ids=seq).logits, seq)[:, prompt - 1:]
            values = critic(seq)[:, prompt - 1:-1]
        step_rewards = -kl * (old_logp - ref_logp)
        step_rewards[:, -1] += score
        adv = gae(step_rewards, values)
        returns = adv + values
        adv = (adv - adv.mean()) / (adv.std() + 1e-6)
        logp = token_logprobs(actor(input_ids=seq).logits, seq)[:, prompt - 1:]
        ratio = torch.exp(logp - old_logp)
        actor_loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
        actor.backward(actor_loss)
        actor.step()
        critic_loss = ((critic(seq)[:, prompt - 1:-1] - returns) ** 2).mean()
        critic.backward(critic_loss)
        critic.step()
        rewards.append(float(score.mean()))
        if rank == 0 and log_every and (it % log_every == 0 or it == iters - 1):
            print(f"iter {it:3d}  reward {rewards[-1]:.3f}  critic loss {critic_loss.item():.4f}", flush=True)
    return rewards


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=4)
    p.add_argument("--new", type=int, default=8, help="tokens generated per rollout")
    p.add_argument("--target", type=int, default=7, help="the token the reward asks for")
    p.add_argument("--kl", type=float, default=0.02, help="KL penalty against the reference")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (actor and critic)")
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    start = time.perf_counter()
    rewards = ppo(args.iters, args.batch, args.prompt, args.new, args.target, args.kl, args.lr)
    if comm.get_rank() == 0:
        print(f"reward {rewards[0]:.3f} -> {rewards[-1]:.3f} in {args.iters} iterations, "
              f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
