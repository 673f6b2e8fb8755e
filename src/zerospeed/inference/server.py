"""An OpenAI-compatible HTTP server over ``ServingEngine`` (FastAPI + uvicorn; the ``serve`` extra).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as Server-Sent
Events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).
One asyncio task drives the engine: while requests are in flight it runs ``engine.step()`` and routes each
new token to its request's queue; handlers only enqueue, await, and cancel (a dropped stream cancels its
request and frees its KV blocks). All engine calls happen on the event loop thread, so no locks are needed
(each forward blocks the loop for its duration: fine for the small models this serves on CPU). With tensor
parallelism this process is rank 0; the other ranks sit in ``engine.run_worker()``, kept alive by a heartbeat
while idle and released by ``engine.shutdown()`` when the app stops.
Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: bad input is 400, a full
queue (``max_tracked_sequences``) is 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .model_dir import LoadedModel
from .sampling import SamplingParams
from .serving import QueueFullError, ServingEngine, TokenEvent

__all__ = ["create_app"]

_HEARTBEAT_S = 60.0


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)


# Accepted at these values only (None always); anything else is a 400 naming the parameter.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "logprobs": (False, 0), "echo": (False,), "best_of": (1,), "suffix": ("",),
    "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},), "stream_options": ({},),
    "tools": ([],), "tool_choice": ("none", "auto"), "response_format": ({"type": "text"},), "top_logprobs": (0,),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        err = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": err}, status_code=self.status)


class _Server:
    """The engine, its driver task and per-request token queues."""

    def __init__(self, loaded: LoadedModel, engine: ServingEngine) -> None:
        self.loaded, self.engine = loaded, engine
        self.queues: dict[int, asyncio.Queue[TokenEvent]] = {}
        self.wake = asyncio.Event()
        self.stats = {"requests_total": 0, "requests_rejected_total": 0, "tokens_generated_total": 0}
        self.task: asyncio.Task[None] | None = None

    async def drive(self) -> None:
        while True:
            if not self.engine.has_work:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), _HEARTBEAT_S)
                except asyncio.TimeoutError:
                    self.engine.heartbeat()  # tensor-parallel workers wait in a collective with a timeout
                    continue
            for ev in self.engine.step():
                self.stats["tokens_generated_total"] += 1
                q = self.queues.get(ev.uid)
                if q is not None:
                    q.put_nowait(ev)
            await asyncio.sleep(0)

    def submit(self, prompt: list[int], params: SamplingParams) -> int:
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        try:
            uid = self.engine.add_request(prompt, params)
        except QueueFullError as exc:
            self.stats["requests_rejected_total"] += 1
            raise ApiError(429, f"server busy: {exc}", None, "rate_limit_error", "rate_limit_exceeded") from None
        except ValueError as exc:
            raise ApiError(400, str(exc), "prompt") from None
        self.stats["requests_total"] += 1
        self.queues[uid] = asyncio.Queue()
        self.wake.set()
        return uid

    async def events(self, uid: int) -> AsyncIterator[TokenEvent]:
        """Tokens of ``uid`` as produced; cancels the request if the consumer goes away early."""
        try:
            q = self.queues[uid]
            while True:
                ev = await q.get()
                if ev.token < 0:
                    return
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            self.finish(uid)

    def finish(self, uid: int) -> None:
        """Forget ``uid``: cancel it (freeing its KV blocks) unless it already finished."""
        q = self.queues.pop(uid, None)
        if q is not None:
            q.put_nowait(TokenEvent(uid, -1, "cancelled"))  # wakes a waiting stream, which then ends
        self.engine.cancel(uid)


def _params(body: _Body, prompt_len: int, default_max: int | None, limit: int) -> SamplingParams:
    for key, neutral in _NEUTRAL.items():
        value = getattr(body, key, None) if key in type(body).model_fields else (body.model_extra or {}).get(key)
        if value is not None and value not in neutral:
            raise ApiError(400, f"'{key}'={value!r} is not supported yet by zerospeed", key)
    max_tokens = body.max_tokens or body.max_completion_tokens or default_max or max(1, limit - prompt_len)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > 4:
        raise ApiError(400, "at most 4 stop sequences", "stop")
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
                          top_p=body.top_p, seed=body.seed, stop=tuple(s for s in stop if s))


def _visible(text: str, params: SamplingParams, done: bool) -> str:
    """Text safe to stream so far: hold back a possible stop-string prefix and a half-decoded character."""
    if done:
        return text
    hold = max((len(s) - 1 for s in params.stop), default=0)
    text = text[: len(text) - hold] if hold else text
    return text.rstrip("\ufffd")


def create_app(loaded: LoadedModel, engine: ServingEngine) -> FastAPI:
    """The FastAPI app serving ``loaded`` through ``engine``."""
    srv = _Server(loaded, engine)
    tok = loaded.tokenizer
    limit = engine.limits.max_context

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        srv.task = asyncio.create_task(srv.drive())
        yield
        srv.task.cancel()
        engine.shutdown()  # tensor parallelism: release the worker ranks

    app = FastAPI(title="zerospeed", docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())[1:]) or None
        return ApiError(400, f"{param or 'body'}: {err.get('msg')}", param).response()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        alloc = engine.scheduler.allocator
        values = {**srv.stats, "requests_running": len(engine.scheduler.running),
                  "requests_waiting": len(engine.scheduler.waiting), "forwards_total": engine.forwards,
                  "tokens_forwarded_total": engine.tokens_forwarded, "kv_blocks_total": alloc.num_blocks,
                  "kv_blocks_free": alloc.num_free}
        return PlainTextResponse("".join(f"zerospeed_{k} {v}\n" for k, v in values.items()))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": loaded.name, "object": "model", "created": 0,
                                            "owned_by": "zerospeed"}]}

    def check_model(body: _Body) -> None:
        if body.model not in (None, loaded.name):
            raise ApiError(404, f"model '{body.model}' does not exist; this server has '{loaded.name}'", "model",
                           code="model_not_found")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> Any:
        check_model(body)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(400, "a batch of prompts is not supported yet by zerospeed", "prompt")
            p = p[0]
        ids = tok.encode(p) if isinstance(p, str) else list(p)
        params = _params(body, len(ids), 16, limit)
        return await _respond(srv, ids, params, body.stream, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody) -> Any:
        check_model(body)
        msgs = [m.model_dump() for m in body.messages]
        if getattr(tok, "chat_template", None):
            ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
        else:  # plain transcript for models without a chat template
            ids = tok.encode("".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:")
        params = _params(body, len(ids), None, limit)
        return await _respond(srv, ids, params, body.stream, chat=True)

    return app


async def _respond(srv: _Server, ids: list[int], params: SamplingParams, stream: bool, chat: bool) -> Any:
    uid = srv.submit(ids, params)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created, name = int(time.time()), srv.loaded.name
    obj = "chat.completion" if chat else "text_completion"
    decode = srv.loaded.tokenizer.decode

    def text_of(out: list[int], done: bool, reason: str | None) -> str:
        text = decode(out)
        if params.stop and reason == "stop":
            cuts = [i for s in params.stop if (i := text.find(s)) >= 0]
            text = text[: min(cuts)] if cuts else text
        return _visible(text, params, done)

    def choice(text: str, reason: str | None, delta: bool) -> dict[str, Any]:
        if not chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        key = "delta" if delta else "message"
        msg = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": 0, key: msg, "logprobs": None, "finish_reason": reason}

    if not stream:
        out, reason = [], None
        async for ev in srv.events(uid):
            out.append(ev.token)
            reason = ev.finish_reason
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)}
        return {"id": rid, "object": obj, "created": created, "model": name,
                "choices": [choice(text_of(out, True, reason), reason, False)], "usage": usage}

    async def sse() -> AsyncIterator[str]:
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": chunk_obj, "created": created, "model": name}
        if chat:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            yield f"data: {json.dumps({**head, 'choices': [first]})}\n\n"
        out: list[int] = []
        sent = ""
        async for ev in srv.events(uid):
            out.append(ev.token)
            text = text_of(out, ev.finish_reason is not None, ev.finish_reason)
            delta = text[len(sent):] if text.startswith(sent) else ""  # a re-spaced decode: wait for the end
            sent = sent + delta
            if delta or ev.finish_reason is not None:
                yield f"data: {json.dumps({**head, 'choices': [choice(delta, ev.finish_reason, True)]})}\n\n"
        yield "data: [DONE]\n\n"

    return _StreamThenCancel(sse(), lambda: srv.finish(uid))


class _StreamThenCancel(StreamingResponse):
    """An SSE response that watches for the client going away and then cancels its request at once.

    (Starlette's own disconnect handling cancels the streaming task through anyio, which did not reach a body
    waiting on our token queue; so the watcher ends the request itself and the body then finishes normally.)
    """

    def __init__(self, body: AsyncIterator[str], on_close: Any) -> None:
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
