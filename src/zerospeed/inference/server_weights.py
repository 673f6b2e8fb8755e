"""``POST /v1/weights``: load new weights into the served model (RL weight sync; a zerospeed route, off by default).

Body ``{"path": "<file>.safetensors"}``: a file this server can read (safetensors only: no pickled code runs),
in the served model's ``state_dict`` names, e.g. written by a training engine's ``save_16bit_model`` through
``zerospeed.runtime.weight_sync.push_weights``. The tensors are copied into the model in place between engine
steps (``ServingEngine.update_weights``; under tensor parallelism each rank keeps its shard; the prefix cache
is emptied); the reply is ``{"updated": <tensors>,
"version": <updates so far>}``. With requests in flight it is 409 (their KV came from the old weights: push
between rollouts); a file that does not fit the model is 400 and changes nothing. The route exists only when the
server is started with ``--enable-weight-updates`` (``ServeOptions.allow_weight_updates``): otherwise 403, since
it lets a client replace the model. The ``/v1`` API key applies.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI, Request

from .server_request import ApiError

__all__ = ["add_weights_route"]


def _load(path: Any) -> dict[str, Any]:
    if not isinstance(path, str) or not path.endswith(".safetensors"):
        raise ApiError(400, "'path' must name a .safetensors file", "path")
    if not os.path.isfile(path):
        raise ApiError(400, f"no such file on the server: {path}", "path")
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file
        raise ApiError(400, f"cannot read {path}: {exc}", "path") from None


def add_weights_route(app: FastAPI, srv: Any, enabled: bool) -> None:
    """Mount ``/v1/weights`` for the server ``srv`` (403 unless ``enabled``)."""

    @app.post("/v1/weights")
    async def weights(request: Request) -> Any:
        if not enabled:
            raise ApiError(403, "weight updates are off: start the server with --enable-weight-updates", None,
                           "permission_error", "weight_updates_disabled")
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the body must be JSON: {\"path\": \"<file>.safetensors\"}", None) from None
        state = _load(body.get("path") if isinstance(body, dict) else None)
        try:
            n = srv.engine.update_weights(state)
        except RuntimeError as exc:
            raise ApiError(409, str(exc), None, "conflict", "requests_in_flight") from None
        except ValueError as exc:
            raise ApiError(400, str(exc), "path") from None
        return {"updated": n, "version": srv.engine.weights_version}
