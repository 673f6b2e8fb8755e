"""The serving engine: requests in, tokens out, one continuous-batching forward per ``step``.

``ServingEngine`` owns the paged KV cache, the scheduler and each request's sampling state. ``step`` asks
the scheduler for a plan (decodes + prefill chunks within the token budget), runs the model once over that
ragged batch, samples a token for every chunk that reached the end of its sequence, and reports the new
tokens. A request ends on ``max_tokens`` ("length"), on an eos / stop token or a stop string ("stop"), or
when cancelled; its KV blocks are freed at once. ``decode`` (token ids -> text) is needed for stop strings.
``compile=True`` runs the model's regions through ``torch.compile`` (see ``compiled``).
``prefix_caching=True`` shares the KV blocks of equal prompt prefixes across requests (see ``prefix_cache``;
greedy tokens are the same with it on or off). ``seed``: requests
without their own seed get one drawn from a generator seeded with it (vLLM's ``--seed``: runs reproduce).
A request that fails (its sampling, or the forward it is in, raises) ends alone with an ``"error"`` event.

Tensor parallelism (``tensor_parallel.tp_size`` > 1, or an ``InferenceEngine`` from ``init_inference`` that is
already sharded, quantized or not): the model is cut as in ``tensor_parallel``; rank 0 of the group owns the
requests, the scheduler and sampling and broadcasts each forward's batch plan; the other ranks call
``run_worker()``, which runs the same forwards over their heads and KV blocks until rank 0's ``shutdown()``
(see ``serving_tp``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from .adapters import DecoderAdapter, adapter_for
from .config import RaggedInferenceEngineConfig
from .engine import InferenceEngine
from .tensor_parallel import resolve_tp_group
from .kv_cache import BlockAllocator, PagedKVCache, RaggedBatch, SeqChunk, long_tensor
from .logits_process import PLAIN, TokenLogprob, process_logits, token_logprob
from .prefix_cache import PrefixCachingAllocator
from .draft_model import DraftModelProposer
from .speculative import SpeculativeConfig, propose_ngram
from .structured import mask_logits
from .speculative_step import spec_step
from .sampling import SamplingParams, sample_next
from .scheduler import Limits, Scheduler, Work
from .serving_tp import FORWARD, STOP, WEIGHTS, PlanChannel
from .serving_weights import copy_weights, fit_weights, receive_weights, send_weights

__all__ = ["QueueFullError", "Request", "ServingEngine", "TokenEvent"]

_log = logging.getLogger("zerospeed.serve")


class QueueFullError(RuntimeError):
    """The engine already tracks ``max_tracked_sequences`` running + waiting requests."""


@dataclass
class Request:
    uid: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    guide: Any = None  # structured output: this request's outlines-core Guide
    spec_skip: int = 0  # speculation: steps to decode without drafting (after drafts were all rejected)
    spec_backoff: int = 1


class TokenEvent(NamedTuple):  # immutable and cheap to build (one per token)
    """One new token of request ``uid``; ``finish_reason`` is set on its last event; ``logprob`` when asked.

    A request that failed (its sampling raised, or the forward it was part of) gets one last event with
    token -1 and finish_reason ``"error"``; the message is in ``ServingEngine.errors[uid]``.
    """

    uid: int
    token: int
    finish_reason: str | None
    logprob: TokenLogprob | None = None


class ServingEngine:
    """Continuous batching over a paged KV cache for one model (see module docstring)."""

    def __init__(self, model: nn.Module, config: RaggedInferenceEngineConfig | dict[str, Any] | None = None,
                 decode: Callable[[list[int]], str] | None = None, eos_token_ids: Sequence[int] = (),
                 compile: bool = False, tp_group: Any = None, seed: int | None = None,
                 prefix_caching: bool = False, speculative: SpeculativeConfig | dict[str, Any] | None = None
                 ) -> None:
        cfg = RaggedInferenceEngineConfig.parse_section(config, "")
        cfg.check_supported()
        sm = cfg.state_manager
        self.config = cfg
        self.tp_group, self.tp_size, self.tp_rank = _setup_tp(model, cfg, tp_group)
        if isinstance(model, InferenceEngine):
            self.model, self.adapter = model.module, model.adapter
        else:
            self.model = model.eval()
            self.adapter = adapter_for(model)
            if self.tp_size > 1:
                from .tensor_parallel import shard_for_inference

                shard_for_inference(self.adapter, self.tp_group, cfg.tensor_parallel.tp_grain_size)
        self.channel = PlanChannel(self.tp_group) if self.tp_size > 1 else None
        if compile:
            self.adapter.compile()  # fused norm/QKV, out-proj/MLP and head regions (eager fallback)
        elif not self.adapter.regions:  # not compiled (here or by init_inference): eager speed-ups
            self.adapter.fuse()  # q/k/v and gate/up as one matmul each, on the model's own weights
        max_context = sm.max_context
        if self.adapter.max_positions is not None:
            max_context = min(max_context, self.adapter.max_positions)
        self.limits = Limits(sm.max_ragged_batch_size, sm.max_ragged_sequence_count, sm.max_tracked_sequences,
                             max_context)
        blocks = sm.memory_config.size
        self.cache = PagedKVCache(self.adapter.num_layers, blocks, sm.kv_block_size, self.adapter.num_kv_heads,
                                  self.adapter.head_dim, self.adapter.dtype, self.adapter.device)
        self.prefix_caching = prefix_caching  # prompt KV blocks shared across requests (see prefix_cache)
        self.speculative = SpeculativeConfig.parse(speculative)  # prompt-lookup drafting (see speculative)
        if self.speculative is not None and self.tp_size > 1:
            raise ValueError("speculative decoding with tensor parallelism is not supported yet by zerospeed")
        self.drafted = self.accepted = 0  # speculative tokens proposed / accepted
        self.proposer = None if self.speculative is None or self.speculative.model is None else \
            _draft_proposer(self.speculative, self.adapter, sm.kv_block_size, blocks)
        allocator = PrefixCachingAllocator(blocks) if prefix_caching else BlockAllocator(blocks)
        self.scheduler = Scheduler(self.limits, allocator, sm.kv_block_size)
        self.decode = decode
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[int, Request] = {}
        self.errors: dict[int, str] = {}  # uid -> why it failed (the server pops it)
        self._seeder = None if seed is None else torch.Generator().manual_seed(seed)  # seeds unseeded requests
        self._uids = itertools.count()
        self.forwards = 0
        self.tokens_forwarded = 0
        self.weights_version = 0  # update_weights calls so far

    def _rank0(self, what: str) -> None:
        if self.tp_rank != 0:
            raise RuntimeError(f"{what} runs on rank 0 of the tensor-parallel group; rank {self.tp_rank} calls "
                               "run_worker()")

    def add_request(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """Queue a request; its uid. ValueError if it can never fit, QueueFullError if the queue is full."""
        self._rank0("add_request")
        if params.stop and self.decode is None:
            raise ValueError("stop strings need a decode function (token ids -> text)")
        if len(self.requests) >= self.limits.max_tracked_sequences:
            raise QueueFullError(f"{len(self.requests)} requests tracked (max_tracked_sequences="
                                 f"{self.limits.max_tracked_sequences})")
        if any(not 0 <= t < self.adapter.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {self.adapter.vocab_size})")
        if self._seeder is not None and params.seed is None and not params.greedy:
            params = dataclasses.replace(params, seed=int(torch.randint(2**62, (), generator=self._seeder)))
        generator = params.generator()  # before queueing: nothing is left behind if this fails
        uid = next(self._uids)
        self.scheduler.add(uid, len(prompt), params.max_tokens, prompt if self.prefix_caching else None)
        self.requests[uid] = Request(uid, list(prompt), params, generator)
        if params.process.guided is not None:
            self.requests[uid].guide = params.process.guided.new()
        return uid

    def cancel(self, uid: int) -> None:
        """Stop a request now and free its KV blocks (no-op if it already finished)."""
        req = self.requests.pop(uid, None)
        if req is not None:
            req.finish_reason = "cancelled"
            self.scheduler.finish(uid)

    def prefix_cache_stats(self) -> tuple[int, int]:
        """``(prompt tokens looked up, found)`` in the prefix cache (``(0, 0)`` while it is off)."""
        alloc = self.scheduler.allocator
        return (alloc.queries, alloc.hits) if isinstance(alloc, PrefixCachingAllocator) else (0, 0)

    @property
    def has_work(self) -> bool:
        return not self.scheduler.idle

    @torch.no_grad()
    def update_weights(self, state: dict[str, torch.Tensor]) -> int:
        """Copy new weights (the unsplit model's ``state_dict`` names and shapes) into the model in place, between
        requests; how many tensors were given. RL weight sync (``zerospeed.runtime.weight_sync.push_weights``, the
        server's ``POST /v1/weights``). In place, so fused and compiled regions see them; the prefix cache (KV of
        the old weights) is emptied. Under tensor parallelism rank 0 broadcasts the tensors and each rank keeps
        its shard (the workers take them inside ``run_worker``; see ``serving_weights``). Refused while requests
        are in flight (their KV came from the old weights)."""
        self._rank0("update_weights")
        if self.has_work:
            raise RuntimeError(f"update_weights: {len(self.requests)} requests in flight (their KV cache holds the "
                               "old weights' keys and values); push weights between rollouts")
        plan = fit_weights(self.model, state)  # ValueError before anything changes
        if self.channel is not None:
            send_weights(self.channel, self.model, plan)
        else:
            copy_weights(self.model, plan)
        alloc = self.scheduler.allocator
        if isinstance(alloc, PrefixCachingAllocator):
            self.scheduler = Scheduler(self.limits, PrefixCachingAllocator(alloc.num_blocks), self.scheduler.block_size)
        self.weights_version += 1
        return len(state)

    def fail(self, uid: int, message: str) -> TokenEvent:
        """End ``uid`` because of an error (logged, kept in ``errors``); its last event."""
        _log.error("request %s failed: %s", uid, message)
        self.errors[uid] = message
        self.cancel(uid)
        return TokenEvent(uid, -1, "error")

    @torch.inference_mode()  # no autograd bookkeeping at all: ~10-20 % less CPU per step than no_grad here
    def step(self) -> list[TokenEvent]:
        """One forward of continuous batching; the tokens it produced.

        A failure fails only what it touched: a sampling error its request, a forward error the requests in
        that forward (``TokenEvent`` with token -1 and finish_reason ``"error"``); the engine keeps serving.
        """
        self._rank0("step")
        work = self.scheduler.schedule()
        if not work:
            return []
        try:
            if self.speculative is not None:
                drafts = self._draft(work)
                if drafts:
                    return spec_step(self, work, drafts)
            return self._step(work)
        except Exception as exc:  # noqa: BLE001 - the forward failed: fail its requests, keep the engine
            return [self.fail(w.uid, f"forward failed: {type(exc).__name__}: {exc}") for w in work
                    if w.uid in self.requests]

    def _step(self, work: list[Work]) -> list[TokenEvent]:
        ids: list[int] = []
        for w in work:
            req = self.requests[w.uid]
            n = len(req.prompt)
            if w.start + w.length <= n:  # a prompt chunk
                ids += req.prompt[w.start:w.start + w.length]
            elif w.start >= n:  # decode: generated tokens only (no prompt + output copy per step)
                ids += req.output[w.start - n:w.start - n + w.length]
            else:
                ids += req.prompt[w.start:] + req.output[:w.start + w.length - n]
        chunks = [SeqChunk(w.block_table, w.start, w.length) for w in work]
        if self.channel is not None:
            self.channel.send_batch(ids, chunks)
        batch = RaggedBatch(long_tensor(ids, self.adapter.device), chunks)
        hidden = self.adapter.hidden(batch.token_ids, batch.positions, self.cache.attention(batch))
        rows = [i for i, w in enumerate(work) if w.samples]
        if len(rows) == hidden.shape[0]:  # every chunk is one token and samples (all decodes): every row
            logits = self.adapter.logits(hidden)
        elif rows:
            ends = list(itertools.accumulate(w.length for w in work))
            logits = self.adapter.logits(hidden[torch.tensor([ends[i] - 1 for i in rows], device=hidden.device)])
        else:
            logits = None
        self.scheduler.commit(work)
        self.forwards += 1
        self.tokens_forwarded += len(ids)
        events = []
        greedy = logits.argmax(-1).tolist() if rows else []  # one call for every greedy request
        for j, i in enumerate(rows):
            req = self.requests[work[i].uid]
            params = req.params
            lp = None
            try:
                if params.process is not PLAIN:  # penalties, biases, min_tokens or logprobs asked for
                    token, lp = self._processed(req, logits[j])
                elif params.temperature == 0.0:
                    token = greedy[j]
                else:
                    token = sample_next(logits[j], params, req.generator)
            except Exception as exc:  # noqa: BLE001 - this request only
                events.append(self.fail(req.uid, f"sampling failed: {exc}"))
                continue
            events.append(self._emit(req, token, lp))
        return events

    def _emit(self, req: Request, token: int, lp: TokenLogprob | None = None) -> TokenEvent:
        """Append ``token`` to ``req``; end it (freeing its blocks) if this token finishes it; its event."""
        params = req.params
        req.output.append(token)
        reason = None  # most tokens end nothing: the checks below run only when one could
        if token in self.eos_token_ids or params.stop or params.stop_token_ids or req.guide is not None or \
                len(req.output) >= params.max_tokens:
            reason = self._finish_reason(req, token)
        if reason is not None:
            req.finish_reason = reason
            if self.decode is not None and not req.params.stop:
                req.text = self.decode(req.output)
            self.scheduler.finish(req.uid)
            del self.requests[req.uid]
        return TokenEvent(req.uid, token, reason, lp)

    def _draft(self, work: list[Work]) -> dict[int, list[int]]:
        """Speculation: drafts for the plain decodes of ``work`` that fit the step's token budget (widened)."""
        assert self.speculative is not None
        budget = self.limits.max_ragged_batch_size - sum(w.length for w in work)
        drafts: dict[int, list[int]] = {}
        wanted: list[tuple[int, Work, Request, int]] = []  # draft model: one batched round for all of them
        for k, w in enumerate(work):
            if budget <= 0:
                break
            req = self.requests[w.uid]
            if w.length != 1 or not w.samples or w.start < len(req.prompt) or req.params.process is not PLAIN:
                continue
            if req.spec_skip > 0:  # its last drafts all failed: back off (doubling, up to 16 steps)
                req.spec_skip -= 1
                continue
            limit = min(budget, req.params.max_tokens - len(req.output) - 1)
            if self.proposer is not None:
                limit = min(limit, self.speculative.num_speculative_tokens)
                if limit > 0:
                    wanted.append((k, w, req, limit))
                    budget -= limit
                continue
            d = propose_ngram(req.prompt + req.output, self.speculative, limit)
            if d:
                work[k] = self.scheduler.widen(w, len(d))
                drafts[w.uid] = d
                budget -= len(d)
        if self.proposer is not None:
            got = self.proposer.propose([(w.uid, req.prompt + req.output, n) for _, w, req, n in wanted],
                                        self.requests)
            for k, w, _, _ in wanted:
                if got.get(w.uid):
                    work[k] = self.scheduler.widen(w, len(got[w.uid]))
                    drafts[w.uid] = got[w.uid]
        return drafts

    def _processed(self, req: Request, row: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """The next token of ``req`` with its logits processing (and its logprob when asked)."""
        opts = req.params.process
        if opts.changes_logits:
            banned = () if len(req.output) >= opts.min_tokens else \
                tuple(set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else self.eos_token_ids))
            row = process_logits(row, opts, req.prompt, req.output, banned)
            if req.guide is not None:
                row = mask_logits(row, req.guide, self.adapter.vocab_size)
        token = int(torch.argmax(row)) if req.params.greedy else sample_next(row, req.params, req.generator)
        if req.guide is not None:
            req.guide.advance(token)
        return token, None if opts.logprobs is None else token_logprob(row, token, opts.logprobs)

    @torch.inference_mode()
    def run_worker(self) -> int:
        """Ranks other than 0 under tensor parallelism: run rank 0's forwards until it shuts down; forwards run."""
        if self.channel is None or self.tp_rank == 0:
            raise RuntimeError("run_worker() is for ranks 1.. of a tensor-parallel serving engine")
        while True:
            kind, batch = self.channel.receive()
            if kind == STOP:
                return self.forwards
            if kind == WEIGHTS:
                assert isinstance(batch, list)
                receive_weights(self.channel, self.model, batch)
                self.weights_version += 1
            if kind == FORWARD:
                assert isinstance(batch, RaggedBatch)
                ids = batch.token_ids.to(self.adapter.device)
                self.adapter.hidden(ids, batch.positions.to(ids.device), self.cache.attention(batch))
                self.forwards += 1
                self.tokens_forwarded += ids.numel()

    def heartbeat(self) -> None:
        """Rank 0, idle: keep the workers' blocking receive from timing out (a no-op without tp)."""
        if self.channel is not None and self.tp_rank == 0:
            self.channel.heartbeat()

    def shutdown(self) -> None:
        """Rank 0: release the workers (their ``run_worker`` returns); idempotent, a no-op without tp."""
        if self.channel is not None and self.tp_rank == 0:
            self.channel.stop()

    def _finish_reason(self, req: Request, token: int) -> str | None:
        if token in req.params.stop_token_ids or token in self.eos_token_ids and not req.params.ignore_eos:
            return "stop"
        if req.guide is not None and req.params.process.guided.finished(req.guide):
            return "stop"  # the structure is complete
        if req.params.stop:
            assert self.decode is not None
            req.text = self.decode(req.output)
            cut = min((i for s in req.params.stop if (i := req.text.find(s)) >= 0), default=-1)
            if cut >= 0:
                req.text = req.text[:cut]
                return "stop"
        if len(req.output) >= req.params.max_tokens:
            return "length"
        return None

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                 ) -> list[Request]:
        """Run the given prompts concurrently to completion (convenience for tests and scripts)."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        reqs = {}
        for p, sp in zip(prompts, plist):
            uid = self.add_request(p, sp)
            reqs[uid] = self.requests[uid]
        while self.has_work:
            self.step()
        return list(reqs.values())


def _draft_proposer(spec: SpeculativeConfig, target: DecoderAdapter, block_size: int, blocks: int
                    ) -> DraftModelProposer:
    """The draft model of ``spec`` (a module, or a directory loaded in the target's dtype and device)."""
    model = spec.model
    if not isinstance(model, nn.Module):
        from .model_dir import load_model_dir

        try:
            model = load_model_dir(model, dtype=target.dtype).model
        except (OSError, ValueError) as exc:
            raise ValueError(f"speculative_config.model: cannot load the draft model {str(spec.model)!r}: {exc}"
                             ) from None
    return DraftModelProposer(model.to(target.device), spec.num_speculative_tokens, block_size, blocks,
                              target.vocab_size)


def _setup_tp(model: nn.Module, cfg: RaggedInferenceEngineConfig, group: Any) -> tuple[Any, int, int]:
    """``(group, tp size, rank in it)`` from the config, an explicit group, or an already sharded engine."""
    from zerospeed import comm

    want = cfg.tensor_parallel.tp_size
    if isinstance(model, InferenceEngine) and model.tp_group is not None:
        have = comm.get_world_size(model.tp_group)
        if want not in (1, have) or (group is not None and group is not model.tp_group):
            raise ValueError(f"the InferenceEngine is sharded over {have} ranks but the serving config asks "
                             f"tensor_parallel.tp_size={want} (or another tp_group)")
        return model.tp_group, have, comm.get_rank(model.tp_group)
    if isinstance(model, InferenceEngine) and want > 1:
        raise ValueError(f"tensor_parallel.tp_size={want}: pass the plain model (the engine shards it) or an "
                         "InferenceEngine made with the same tensor_parallel.tp_size")
    if want == 1:
        if group is not None and comm.get_world_size(group) > 1:
            raise ValueError("tp_group given but tensor_parallel.tp_size is 1")
        return None, 1, 0
    group = resolve_tp_group(want, group, "call zerospeed.init_distributed() on every rank (or `zerospeed serve "
                             "--tp-size`)")
    return group, want, comm.get_rank(group)
