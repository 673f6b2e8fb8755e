"""Reading an OpenAI request body: bytes -> checked JSON -> a validated body -> ``SamplingParams``.

Everything wrong with a request is an ``ApiError`` (OpenAI's error body, 4xx) naming what is wrong, never a
500 or FastAPI's own body: bytes that are not UTF-8, JSON that does not parse or is nested too deep, a
string holding a lone surrogate (JSON allows ``"\\ud800"``, UTF-8 cannot encode it), a parameter that is
neither OpenAI's nor one of vLLM's extra fields (``"max_tokenz"``: 400 with a did-you-mean), and a known
parameter we do not implement at a value that would change the result (400 "not supported yet").
"""

from __future__ import annotations

import difflib
import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .logits_process import PLAIN, LogitsOptions
from .sampling import SEED_MAX, SEED_MIN, SamplingParams

__all__ = ["ApiError", "ChatBody", "CompletionBody", "EmbeddingBody", "parse_body", "sampling_params", "structure_of"]

MAX_DEPTH = 64  # OpenAI bodies are a few levels deep; deeper JSON is refused before it is parsed


class ApiError(Exception):
    """An HTTP error with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        err = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": err}, status_code=self.status)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown names are checked by parse_body (400 naming them)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM: -1 (or 0) = all
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)


class CompletionBody(_Body):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=5)  # the chosen token's and this many alternatives
    echo: bool = False


class EmbeddingBody(BaseModel):
    """``/v1/embeddings``: one text, a batch of texts, one token list or a batch of them."""

    model_config = ConfigDict(extra="allow")  # unknown names are checked by parse_body

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


# Known names: OpenAI's parameters and vLLM's extra fields. Implemented ones are fields of the bodies above;
# the others are accepted at their neutral value only (None always), else a 400 naming them.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "best_of": (1,), "suffix": ("",), "tools": ([],),
    "tool_choice": ("none", "auto"), "top_logprobs": (0,), "min_p": (0,),
    "parallel_tool_calls": (True, False), "functions": ([],), "function_call": ("none", "auto"),
    "guided_grammar": (), "prediction": (),
    "audio": (), "modalities": (["text"],), "reasoning_effort": (), "web_search_options": (),
}
_IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
            "skip_special_tokens", "spaces_between_special_tokens", "add_generation_prompt", "verbosity")


def _depth_ok(text: str) -> bool:
    """Bracket depth of ``text`` stays within ``MAX_DEPTH`` (brackets inside strings are not counted)."""
    depth, in_str, esc = 0, False, False
    for ch in text:
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def _check_strings(obj: Any) -> None:
    """ApiError naming the first string that holds a lone surrogate (not encodable as UTF-8)."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack += [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
            stack += [(path or "body", k) for k in value]  # keys are strings too
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, f"'{path}' holds a lone surrogate, which is not valid Unicode text",
                               path.split(".")[0].split("[")[0] or None) from None


def parse_body(raw: bytes, kind: type[BaseModel]) -> Any:
    """The validated body of ``kind`` from raw request bytes; ApiError (400) for anything malformed."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {exc.start})") from None
    if text.count("[") + text.count("{") > MAX_DEPTH and not _depth_ok(text):
        raise ApiError(400, f"the request body is JSON nested deeper than {MAX_DEPTH} levels")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_strings(obj)
    known = set(kind.model_fields) | (set(_NEUTRAL) | set(_IGNORED) if issubclass(kind, _Body) else {"user"})
    for key in obj:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ApiError(400, f"unknown parameter '{key}'{hint}", key, code="unknown_parameter")
    try:
        return kind.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        raise ApiError(400, f"{param or 'body'}: {err.get('msg')}", param.split(".")[0] if param else None) \
            from None


def structure_of(body: _Body) -> tuple[str, str, Any] | None:
    """``(parameter, kind, spec)`` of the structured output ``body`` asks for (at most one), else None."""
    asked = []
    rf = body.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            asked.append(("response_format", "json", None))
        elif kind == "json_schema":
            schema = (rf.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                               "response_format")
            asked.append(("response_format", "json", schema))
        elif kind != "text":
            raise ApiError(400, f"response_format type {kind!r}: expected text, json_object or json_schema",
                           "response_format")
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
        value = getattr(body, name)
        if value is not None:
            asked.append((name, kind, value))
    if len(asked) > 1:
        raise ApiError(400, f"give one structured-output parameter, got {[a[0] for a in asked]}", asked[1][0])
    return asked[0] if asked else None


def sampling_params(body: _Body, prompt_len: int, default_max: int | None, limit: int,
                    guide: Any = None) -> SamplingParams:
    """The engine's settings for ``body`` (``guide``: its compiled structure, if any); ApiError naming a
    parameter we do not support at its value."""
    extra = body.model_extra or {}
    for key, neutral in _NEUTRAL.items():
        value = extra.get(key)
        if value is not None and value not in neutral:
            raise ApiError(400, f"'{key}'={value!r} is not supported yet by zerospeed", key)
    max_tokens = body.max_tokens or body.max_completion_tokens or default_max or max(1, limit - prompt_len)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > 4:
        raise ApiError(400, "at most 4 stop sequences", "stop")
    opts = body.stream_options or {}
    if set(opts) - {"include_usage", "continuous_usage_stats"} or not body.stream and opts:
        raise ApiError(400, "stream_options takes include_usage, and only with stream=true", "stream_options")
    if body.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_k=max(body.top_k, 0),
                          top_p=body.top_p, seed=body.seed, stop=tuple(s for s in stop if s),
                          stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                          process=_logits_options(body, guide))


def _logits_options(body: _Body, guide: Any) -> LogitsOptions:
    """Penalties, biases, min_tokens and logprobs of ``body`` (the shared default when all are neutral)."""
    if isinstance(body, ChatBody):
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        top = (body.top_logprobs or 0) if body.logprobs else None
    else:
        top = getattr(body, "logprobs", None)
    bias: list[tuple[int, float]] = []
    for key, value in (body.logit_bias or {}).items():
        if not key.lstrip("-").isdigit() or not -100.0 <= value <= 100.0:
            raise ApiError(400, f"logit_bias: keys are token ids and values in [-100, 100], got {key!r}: {value}",
                           "logit_bias")
        bias.append((int(key), float(value)))
    opts = LogitsOptions(body.repetition_penalty, body.frequency_penalty, body.presence_penalty, tuple(bias),
                         body.min_tokens, top, guide)
    return PLAIN if opts == PLAIN else opts
