"""An OpenAI-compatible HTTP server over ``ServingEngine`` (FastAPI + uvicorn; the ``serve`` extra).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as Server-Sent
Events ending in ``data: [DONE]``), ``POST /v1/embeddings`` (see ``server_embeddings``), ``POST /v1/weights`` (RL weight sync, when enabled: see
``server_weights``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).
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
import hmac
import logging
from collections.abc import AsyncIterator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse

from .metrics import ServerMetrics
from .model_dir import LoadedModel
from .prompt_forward import prompt_logprobs
from .sampling import SamplingParams
from .server_request import ApiError, ChatBody, CompletionBody, parse_body, sampling_params, structure_of
from .server_embeddings import add_embeddings_route
from .server_weights import add_weights_route
from .server_response import respond as _respond
from .serving import QueueFullError, ServingEngine, TokenEvent

__all__ = ["ServeOptions", "create_app"]

_log = logging.getLogger("zerospeed.serve")

_HEARTBEAT_S = 60.0


@dataclass(frozen=True)
class ServeOptions:
    """How the app presents the model: its names, the API key, and what to do if the engine loop dies.

    ``served_model_names``: the names clients may ask for (vLLM's ``--served-model-name``; default the model
    directory's name); the first is the one reported. ``api_key``: when set, every ``/v1`` route needs
    ``Authorization: Bearer <key>`` (401 otherwise); ``/health`` and ``/metrics`` stay open. ``on_fatal``:
    called with the exception if the task driving the engine dies (the launcher stops the process, exit 1).
    """

    served_model_names: Sequence[str] = ()
    api_key: str | None = None
    on_fatal: Callable[[BaseException], None] | None = None
    allow_weight_updates: bool = False  # POST /v1/weights (server_weights): off unless --enable-weight-updates


class _Server:
    """The engine, its driver task and per-request token queues."""

    def __init__(self, loaded: LoadedModel, engine: ServingEngine, options: ServeOptions) -> None:
        self.loaded, self.engine, self.options = loaded, engine, options
        self.names = tuple(options.served_model_names) or (loaded.name,)
        self.queues: dict[int, asyncio.Queue[TokenEvent]] = {}
        self.wake = asyncio.Event()
        self.stats = {"requests_total": 0, "requests_rejected_total": 0, "requests_failed_total": 0,
                      "tokens_generated_total": 0}
        self.metrics = ServerMetrics()
        self.task: asyncio.Task[None] | None = None
        self.fatal: str | None = None  # why the driving task died, if it did

    async def drive(self) -> None:
        while True:
            if not self.engine.has_work:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), _HEARTBEAT_S)
                except asyncio.TimeoutError:
                    self.engine.heartbeat()  # tensor-parallel workers wait in a collective with a timeout
                    continue
            for ev in self.engine.step():  # a failing request comes back as an "error" event: loop goes on
                if ev.token >= 0:
                    self.stats["tokens_generated_total"] += 1
                    self.metrics.token(ev.uid, ev.finish_reason)
                else:
                    self.stats["requests_failed_total"] += 1
                    self.metrics.ended(ev.uid, "error")
                q = self.queues.get(ev.uid)
                if q is not None:
                    q.put_nowait(ev)
            await asyncio.sleep(0)

    def start(self) -> None:
        self.task = asyncio.create_task(self.drive())
        self.task.add_done_callback(self._died)

    def _died(self, task: asyncio.Task[None]) -> None:
        """The driving task ended: unless cancelled at shutdown, fail everything in flight and report it."""
        if task.cancelled():
            return
        exc = task.exception() or RuntimeError("the engine loop returned")
        self.fatal = f"{type(exc).__name__}: {exc}"
        _log.critical("the engine loop died (%s); failing %d requests", self.fatal, len(self.queues),
                      exc_info=exc)
        for uid, q in list(self.queues.items()):
            self.engine.errors[uid] = f"the engine loop died: {self.fatal}"
            q.put_nowait(TokenEvent(uid, -1, "error"))
        if self.options.on_fatal is not None:
            self.options.on_fatal(exc)

    def submit(self, prompt: list[int], params: SamplingParams) -> int:
        if self.fatal is not None:
            raise ApiError(503, f"the engine loop died ({self.fatal}); the server is stopping", None,
                           "server_error", "engine_dead")
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
        self.metrics.submitted(uid, len(prompt))
        self.queues[uid] = asyncio.Queue()
        self.wake.set()
        return uid

    async def events(self, uid: int) -> AsyncIterator[TokenEvent]:
        """Tokens of ``uid`` as produced; ApiError (500) if it failed; cancels it if the consumer leaves early."""
        try:
            q = self.queues[uid]
            while True:
                ev = await q.get()
                if ev.token < 0:
                    if ev.finish_reason == "error":
                        why = self.engine.errors.pop(uid, "unknown error")
                        raise ApiError(500, f"the request failed: {why}", None, "server_error", "request_failed")
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
        self.engine.errors.pop(uid, None)
        self.metrics.ended(uid, "abort")  # a no-op unless it had not finished


def create_app(loaded: LoadedModel, engine: ServingEngine, options: ServeOptions | None = None) -> FastAPI:
    """The FastAPI app serving ``loaded`` through ``engine`` (names, API key: ``options``)."""
    srv = _Server(loaded, engine, options or ServeOptions())
    tok = loaded.tokenizer
    limit = engine.limits.max_context

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        srv.start()
        yield
        assert srv.task is not None
        srv.task.cancel()
        engine.shutdown()  # tensor parallelism: release the worker ranks

    app = FastAPI(title="zerospeed", docs_url=None, redoc_url=None, lifespan=lifespan)
    _add_error_handlers(app)
    if srv.options.api_key:
        _add_auth(app, srv.options.api_key)

    @app.get("/health")
    async def health() -> JSONResponse:
        if srv.fatal is not None:
            return JSONResponse({"status": "error", "message": f"the engine loop died: {srv.fatal}"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        alloc = engine.scheduler.allocator
        values = {**srv.stats, "requests_running": len(engine.scheduler.running),
                  "requests_waiting": len(engine.scheduler.waiting), "forwards_total": engine.forwards,
                  "tokens_forwarded_total": engine.tokens_forwarded, "kv_blocks_total": alloc.num_blocks,
                  "kv_blocks_free": alloc.num_free}
        gauges = {"running": values["requests_running"], "waiting": values["requests_waiting"],
                  "kv_usage": 1.0 - alloc.num_free / max(1, alloc.num_blocks)}
        queries, hits = engine.prefix_cache_stats()
        vllm = srv.metrics.render(srv.names[0], gauges, queries, hits)
        return PlainTextResponse(vllm + "".join(f"zerospeed_{k} {v}\n" for k, v in values.items()),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "zerospeed",
                                            "root": loaded.name, "max_model_len": limit} for n in srv.names]}

    def model_name(body: Any) -> str:
        if body.model is None:
            return srv.names[0]
        if body.model not in srv.names:
            raise ApiError(404, f"model '{body.model}' does not exist; this server has {list(srv.names)}",
                           "model", code="model_not_found")
        return str(body.model)

    structured: list[Any] = []  # the StructuredOutput compiler, made on first use

    def guide_for(body: Any) -> Any:
        asked = structure_of(body)
        if asked is None:
            return None
        param, kind, spec = asked
        try:
            if not structured:
                from .structured import StructuredOutput

                structured.append(StructuredOutput(tok, engine.adapter.vocab_size, loaded.eos_token_ids))
            from .structured import regex_for

            return structured[0].spec(regex_for(kind, spec))
        except ImportError:
            raise ApiError(400, "structured output needs outlines-core: pip install 'zerospeed[serve]'",
                           param) from None
        except (ValueError, TypeError, KeyError) as exc:
            raise ApiError(400, f"{param}: {exc}", param) from None

    def encode(text: str) -> list[int]:
        try:
            return list(tok.encode(text))
        except Exception as exc:  # noqa: BLE001 - the tokenizer's own complaint about the text
            raise ApiError(400, f"the prompt cannot be tokenized: {exc}", "prompt") from None

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = parse_body(await request.body(), CompletionBody)
        name = model_name(body)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(400, "a batch of prompts is not supported yet by zerospeed", "prompt")
            p = p[0]
        ids = encode(p) if isinstance(p, str) else list(p)
        if not all(0 <= t < engine.adapter.vocab_size for t in ids):  # before echo decodes them
            raise ApiError(400, f"prompt token ids must be in [0, {engine.adapter.vocab_size})", "prompt")
        params = sampling_params(body, len(ids), 16, limit, guide_for(body))
        echo = (p if isinstance(p, str) else tok.decode(ids)) if body.echo else ""
        prompt_lps = None
        if body.echo and body.logprobs is not None and ids:  # vLLM's prompt logprobs: one dense forward
            if engine.tp_size > 1:
                raise ApiError(400, "'echo' with 'logprobs' under tensor parallelism is not supported yet by "
                               "zerospeed", "echo")
            if len(ids) > limit:
                raise ApiError(400, f"the prompt has {len(ids)} tokens; this model takes at most {limit}", "prompt")
            prompt_lps = prompt_logprobs(engine.adapter, ids, body.logprobs)
        return await _respond(srv, ids, params, body, name, chat=False, echo=echo, prompt_lps=prompt_lps)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = parse_body(await request.body(), ChatBody)
        name = model_name(body)
        msgs = [m.model_dump() for m in body.messages]
        if getattr(tok, "chat_template", None):
            try:
                ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
            except Exception as exc:  # noqa: BLE001 - the template rejected these messages
                raise ApiError(400, f"the chat template failed on these messages: {exc}", "messages") from None
        else:  # plain transcript for models without a chat template
            ids = encode("".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:")
        params = sampling_params(body, len(ids), None, limit, guide_for(body))
        return await _respond(srv, ids, params, body, name, chat=True)

    add_embeddings_route(app, srv, model_name, encode, limit)
    add_weights_route(app, srv, srv.options.allow_weight_updates)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's error body: ours, FastAPI's validation errors, and unexpected ones."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())[1:]) or None
        return ApiError(400, f"{param or 'body'}: {err.get('msg')}", param).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        _log.exception("internal error", exc_info=exc)
        return ApiError(500, f"internal error: {type(exc).__name__}", None, "server_error").response()


def _add_auth(app: FastAPI, key: str) -> None:
    """``Authorization: Bearer <key>`` on every ``/v1`` route (compared in constant time), else 401."""
    want = f"Bearer {key}".encode()

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Any:
        if request.url.path.startswith("/v1"):
            got = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(got, want):
                return ApiError(401, "Incorrect API key provided (send it as 'Authorization: Bearer <key>')",
                                None, "invalid_request_error", "invalid_api_key").response()
        return await call_next(request)
