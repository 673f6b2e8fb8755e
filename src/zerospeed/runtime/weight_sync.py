"""Weight sync from a training engine into a serving engine or a running ``zerospeed serve`` (RL with a separate
generation server, as OpenRLHF / verl do with vLLM).

``push_weights(engine, target, path)`` is collective over the engine's ranks. They write the current weights with
``engine.save_16bit_model`` (gathered under ZeRO-3, every expert under its global id, tensor-parallel shards
joined: the file ``zerospeed serve`` could load as a model), then rank 0 hands the file to ``target``:

* a URL (``"http://host:port"``): ``POST {url}/v1/weights {"path": ...}`` (``inference/server_weights.py``; the
  server must be started with ``--enable-weight-updates`` and read ``path``: same machine or a shared disk);
* a ``ServingEngine`` in this process: ``target.update_weights(tensors)``.

Rank 0's outcome is broadcast, so every rank returns the server's reply (``{"updated", "version"}``) or raises
the same error: no rank runs ahead into the next collective while another failed.
"""

from __future__ import annotations

import json
import os
import tempfile
import urllib.error
import urllib.request
from typing import Any

from .. import comm


def _post(url: str, path: str, api_key: str | None, timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url.rstrip("/") + "/v1/weights", data=json.dumps({"path": path}).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        raise RuntimeError(f"push_weights: {url} answered {exc.code}: {body}") from None
    except urllib.error.URLError as exc:
        raise RuntimeError(f"push_weights: cannot reach {url}: {exc.reason}") from None


def push_weights(engine: Any, target: Any, path: str | None = None, api_key: str | None = None,
                 timeout: float = 120.0) -> dict[str, Any]:
    """Collective: the engine's current weights into ``target`` (a server URL, or a ``ServingEngine`` on rank 0;
    other ranks may pass None); ``path``: the file to write (default: one in the system's temp directory)."""
    path = path or os.path.join(tempfile.gettempdir(), f"zerospeed-weights-{os.getuid()}.safetensors")
    folder, name = os.path.split(os.path.abspath(path))
    if not name.endswith(".safetensors"):
        raise ValueError(f"push_weights: path must end in .safetensors, got {path!r}")
    written = comm.all_gather_object(bool(engine.save_16bit_model(folder, name)))
    if True not in written:
        raise RuntimeError("push_weights: save_16bit_model wrote the weights on no rank")
    outcome: tuple[bool, Any] | None = None
    if comm.get_rank() == written.index(True):  # one rank (the first writer) hands the file over
        try:
            if isinstance(target, str):
                outcome = (True, _post(target, os.path.join(folder, name), api_key, timeout))
            else:
                from safetensors.torch import load_file

                n = target.update_weights(load_file(os.path.join(folder, name)))
                outcome = (True, {"updated": n, "version": target.weights_version})
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            outcome = (False, f"{type(exc).__name__}: {exc}")
    ok, value = next(o for o in comm.all_gather_object(outcome) if o is not None)
    if not ok:
        raise RuntimeError(f"push_weights failed on the writing rank: {value}")
    return value
