"""Turning a request's token events into OpenAI's response: one JSON body, or Server-Sent Events.

``n`` > 1 submits ``n`` engine requests for the same prompt (with a ``seed``, choice ``i`` uses ``seed + i``,
so each choice is reproducible) and reports them as choices ``0 .. n-1``. A stream interleaves the choices'
chunks as tokens arrive, ends with a usage chunk when ``stream_options.include_usage`` is set, then
``data: [DONE]``; a request that fails mid-stream sends OpenAI's error object as its last event. A client that
goes away cancels every choice at once (their KV blocks are freed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from .sampling import SEED_MAX, SamplingParams
from .server_request import ApiError

__all__ = ["respond"]


def _visible(text: str, params: SamplingParams, done: bool) -> str:
    """Text safe to stream so far: hold back a possible stop-string prefix and a half-decoded character."""
    if done:
        return text
    hold = max((len(s) - 1 for s in params.stop), default=0)
    text = text[: len(text) - hold] if hold else text
    return text.rstrip("\ufffd")


def _choice_params(params: SamplingParams, i: int) -> SamplingParams:
    if i == 0 or params.seed is None:
        return params
    seed = params.seed + i if params.seed + i <= SEED_MAX else params.seed - i
    return dataclasses.replace(params, seed=seed)


def _submit_all(srv: Any, ids: list[int], params: SamplingParams, n: int) -> list[int]:
    uids: list[int] = []
    try:
        for i in range(n):
            uids.append(srv.submit(ids, _choice_params(params, i)))
    except ApiError:
        for u in uids:
            srv.finish(u)
        raise
    return uids


def _logprobs(lps: list[Any], decode: Callable[[list[int]], str], chat: bool, offset: int) -> dict[str, Any]:
    """OpenAI's ``logprobs`` object for these ``TokenLogprob`` (completions: parallel lists; chat: content)."""
    def tok(t: int) -> str:
        return decode([t])

    if chat:
        def entry(t: int, lp: float) -> dict[str, Any]:
            return {"token": tok(t), "logprob": lp, "bytes": list(tok(t).encode("utf-8", "replace"))}

        return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                            for x in lps]}
    tokens = [tok(x.token) for x in lps]
    offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [None if x.top is None else {tok(t): v for t, v in x.top} for x in lps],
            "text_offset": offsets}


async def respond(srv: Any, ids: list[int], params: SamplingParams, body: Any, name: str, chat: bool,
                  echo: str = "", prompt_lps: list[Any] | None = None) -> Any:
    """The response to one completion / chat request (``body`` gives ``n``, ``stream``, ``stream_options``).

    ``echo``: text put before each choice's completion (the prompt, for ``echo: true``); ``prompt_lps``: the
    prompt tokens' logprobs, reported before the completion's (``echo`` with ``logprobs``).
    """
    uids = _submit_all(srv, ids, params, body.n)
    want_lp = params.process.logprobs is not None
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    head = {"id": rid, "created": int(time.time()), "model": name}
    decode = srv.loaded.tokenizer.decode

    def text_of(out: list[int], done: bool, reason: str | None) -> str:
        text = decode(out)
        if params.stop and reason == "stop":
            cuts = [i for s in params.stop if (i := text.find(s)) >= 0]
            text = text[: min(cuts)] if cuts else text
        return _visible(text, params, done)

    def choice(i: int, text: str, reason: str | None, delta: bool, lps: list[Any], offset: int = 0
               ) -> dict[str, Any]:
        lp = _logprobs(lps, decode, chat, offset) if want_lp else None
        if not chat:
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
        key = "delta" if delta else "message"
        msg = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": i, key: msg, "logprobs": lp, "finish_reason": reason}

    def usage(completion: int) -> dict[str, int]:
        return {"prompt_tokens": len(ids), "completion_tokens": completion, "total_tokens": len(ids) + completion}

    if not body.stream:
        async def collect(uid: int) -> tuple[list[int], str | None, list[Any]]:
            out, reason, lps = [], None, []
            async for ev in srv.events(uid):
                out.append(ev.token)
                reason = ev.finish_reason
                if ev.logprob is not None:
                    lps.append(ev.logprob)
            return out, reason, lps

        try:
            results = await asyncio.gather(*(collect(u) for u in uids))
        finally:
            for u in uids:
                srv.finish(u)
        head_lps = prompt_lps or []
        choices = [choice(i, echo + text_of(out, True, r), r, False, head_lps + lps, 0 if head_lps else len(echo))
                   for i, (out, r, lps) in enumerate(results)]
        return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                "usage": usage(sum(len(out) for out, _, _ in results))}

    include_usage = bool((body.stream_options or {}).get("include_usage"))

    async def sse() -> AsyncIterator[str]:
        chunk = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        if chat:
            first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                     for i in range(len(uids))]
            yield f"data: {json.dumps({**chunk, 'choices': first})}\n\n"
        outs: list[list[int]] = [[] for _ in uids]
        sent = ["" for _ in uids]
        pending: list[list[Any]] = [[] for _ in uids]  # logprobs of tokens not yet sent
        if echo:
            for i in range(len(uids)):
                c = choice(i, echo, None, True, prompt_lps or [])
                yield f"data: {json.dumps({**chunk, 'choices': [c]})}\n\n"
        try:
            async for i, ev in _merged(srv, uids):
                outs[i].append(ev.token)
                if ev.logprob is not None:
                    pending[i].append(ev.logprob)
                text = text_of(outs[i], ev.finish_reason is not None, ev.finish_reason)
                delta = text[len(sent[i]):] if text.startswith(sent[i]) else ""  # re-spaced decode: wait
                if delta or ev.finish_reason is not None:
                    c = choice(i, delta, ev.finish_reason, True, pending[i], len(echo) + len(sent[i]))
                    pending[i] = []
                    yield f"data: {json.dumps({**chunk, 'choices': [c]})}\n\n"
                sent[i] += delta
        except ApiError as exc:
            err = {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.code}
            yield f"data: {json.dumps({'error': err})}\n\n"
        else:
            if include_usage:
                total = sum(len(o) for o in outs)
                yield f"data: {json.dumps({**chunk, 'choices': [], 'usage': usage(total)})}\n\n"
        yield "data: [DONE]\n\n"

    return _StreamThenCancel(sse(), lambda: [srv.finish(u) for u in uids])


async def _merged(srv: Any, uids: list[int]) -> AsyncIterator[tuple[int, Any]]:
    """``(choice index, event)`` from every request in ``uids``, in arrival order; the first error is raised."""
    if len(uids) == 1:  # the common case: no tasks
        async for ev in srv.events(uids[0]):
            yield 0, ev
        return
    q: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, uid: int) -> None:
        try:
            async for ev in srv.events(uid):
                q.put_nowait((i, ev))
        except ApiError as exc:
            q.put_nowait((i, exc))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, u)) for i, u in enumerate(uids)]
    try:
        left = len(uids)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, ApiError):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for u in uids:
            srv.finish(u)


class _StreamThenCancel(StreamingResponse):
    """An SSE response that watches for the client going away and then cancels its request at once.

    (Starlette's own disconnect handling cancels the streaming task through anyio, which did not reach a body
    waiting on our token queue; so the watcher ends the request itself and the body then finishes normally.)
    """

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], Any]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.on_close()

        watcher = asyncio.create_task(watch())
        try:
            await self.stream_response(send)
        finally:
            watcher.cancel()
            self.on_close()
