"""``POST /v1/embeddings``: OpenAI's embeddings API over the served model (see ``prompt_forward.embedding``).

Each input (a text, or a list of token ids; one or a batch) is embedded as its last token's final-norm hidden
state, L2-normalised: vLLM's default pooling for decoder models. ``encoding_format`` ``float`` gives lists of
numbers, ``base64`` the little-endian float32 bytes (what the official ``openai`` client asks for by default).
``dimensions`` other than the model's own width is refused (400): these embeddings are not Matryoshka-trained,
so truncating them would not be what the parameter promises. Empty, over-long or out-of-vocabulary inputs are
400s naming the input. The forwards run on the event loop, as the engine's do.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from .prompt_forward import embedding
from .server_request import ApiError, EmbeddingBody, parse_body

__all__ = ["add_embeddings_route"]

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


def _token_lists(body: EmbeddingBody, encode: Callable[[str], list[int]]) -> list[list[int]]:
    x = body.input
    if isinstance(x, str):
        return [encode(x)]
    if not x:
        raise ApiError(400, "input must not be empty", "input")
    if isinstance(x[0], int):
        return [list(x)]  # type: ignore[arg-type]
    return [encode(s) if isinstance(s, str) else list(s) for s in x]


def add_embeddings_route(app: FastAPI, srv: Any, model_name: Callable[[Any], str],
                         encode: Callable[[str], list[int]], limit: int) -> None:
    """Mount ``/v1/embeddings`` for the server ``srv`` (its engine's adapter does the forwards)."""
    engine = srv.engine

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        body = parse_body(await request.body(), EmbeddingBody)
        name = model_name(body)
        if engine.tp_size > 1:
            raise ApiError(400, "embeddings under tensor parallelism are not supported yet by zerospeed", "model")
        batch = _token_lists(body, encode)
        if len(batch) > MAX_INPUTS:
            raise ApiError(400, f"at most {MAX_INPUTS} inputs per request, got {len(batch)}", "input")
        vocab = engine.adapter.vocab_size
        for i, ids in enumerate(batch):
            if not ids:
                raise ApiError(400, f"input[{i}] is empty", "input")
            if len(ids) > limit:
                raise ApiError(400, f"input[{i}] has {len(ids)} tokens; this model takes at most {limit}", "input")
            if min(ids) < 0 or max(ids) >= vocab:
                raise ApiError(400, f"input[{i}] holds a token id outside 0..{vocab - 1}", "input")
        vectors = [embedding(engine.adapter, ids) for ids in batch]
        width = vectors[0].numel()
        if body.dimensions not in (None, width):
            raise ApiError(400, f"dimensions={body.dimensions} is not supported yet by zerospeed (this model's "
                           f"embeddings have {width})", "dimensions")

        def encoded(v: Any) -> Any:
            if body.encoding_format == "float":
                return v.tolist()
            return base64.b64encode(v.numpy().astype("<f4").tobytes()).decode("ascii")

        data = [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)]
        used = sum(len(ids) for ids in batch)
        return {"object": "list", "data": data, "model": name,
                "usage": {"prompt_tokens": used, "total_tokens": used}}
