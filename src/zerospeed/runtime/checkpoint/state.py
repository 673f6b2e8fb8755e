"""Small state as JSON (never pickle): RNG states, scheduler/scaler/engine counters, client state.

JSON keeps every Python float exactly (``repr`` round-trips), so restoring these is bitwise. Tensors
found inside client state are moved to a safetensors file and replaced by ``{"__tensor__": key}``;
tuples come back as lists; anything else that JSON cannot hold is refused at save time, naming its path.
"""

from __future__ import annotations

import base64
import math
import random
from typing import Any

import torch

from ...accelerator import get_accelerator

_TENSOR = "__tensor__"


def to_json(obj: Any, where: str, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    """A JSON-able copy of ``obj``; tensors go to ``tensors`` (when given) or, if scalar, become numbers."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise ValueError(f"{where}: key {k!r} is not a string; checkpoints store JSON, never pickle")
            out[str(k)] = to_json(v, f"{where}.{k}", tensors)
        if _TENSOR in out:
            raise ValueError(f"{where}: the key {_TENSOR!r} is reserved")
        return out
    if isinstance(obj, (list, tuple)):
        return [to_json(v, f"{where}[{i}]", tensors) for i, v in enumerate(obj)]
    if torch.is_tensor(obj):
        if tensors is not None:
            key = f"t{len(tensors)}"
            tensors[key] = obj.detach().to("cpu").clone()
            return {_TENSOR: key}
        if obj.numel() == 1:
            return obj.item()
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "size", 2) == 1:  # numpy scalars
        return obj.item()
    raise ValueError(f"{where}: a {type(obj).__name__} cannot be stored; checkpoint state must be JSON-able "
                     "(dict/list/str/int/float/bool/None, or tensors in client_state), never pickle")


def from_json(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR}:
            return tensors[obj[_TENSOR]]
        return {k: from_json(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json(v, tensors) for v in obj]
    return obj


def _b64(t: torch.Tensor | None) -> str | None:
    return None if t is None else base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str | None) -> torch.Tensor | None:
    return None if s is None else torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU, the accelerator, Python ``random``, numpy."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch_cpu": _b64(torch.get_rng_state()), "device": _b64(get_accelerator().get_rng_state()),
                             "python": [version, list(internal), gauss]}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    return state


def check_rng_state(state: Any, where: str) -> None:
    """Raise ``CheckpointError`` naming the field unless ``state`` is what ``rng_state`` writes, so a bad RNG
    file fails while the load is staged, before anything is applied."""
    from .errors import CheckpointError

    def bad(field: str) -> CheckpointError:
        return CheckpointError(f"{where}: field {field!r} is not an RNG state this process can restore")

    if not isinstance(state, dict):
        raise bad("(top level)")
    try:
        cpu = _unb64(state["torch_cpu"])
    except (KeyError, TypeError, ValueError):
        raise bad("torch_cpu") from None
    if cpu is None or cpu.numel() != torch.get_rng_state().numel():
        raise bad("torch_cpu")
    try:
        if state.get("device") is not None:
            _unb64(state["device"])
        version, internal, gauss = state["python"]
        random.Random().setstate((version, tuple(internal), gauss))
    except (KeyError, TypeError, ValueError):
        raise bad("device" if "python" in state else "python") from None
    if "numpy" in state:
        try:
            import numpy as np

            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.RandomState().set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        except (TypeError, ValueError, OverflowError):
            raise bad("numpy") from None


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    if state.get("device") is not None:
        get_accelerator().set_rng_state(_unb64(state["device"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def param_group_options(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The hyperparameters of each optimizer group (everything but ``params``), JSON-able."""
    out = []
    for gi, g in enumerate(groups):
        opts = {}
        for k, v in g.items():
            if k == "params":
                continue
            try:
                opts[k] = to_json(v, f"optimizer.param_groups[{gi}].{k}")
            except ValueError:
                continue  # e.g. a callable: rebuilt from the config, not from the checkpoint
        out.append(opts)
    return out


def restore_param_group_options(groups: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    if len(saved) != len(groups):
        raise ValueError(f"the checkpoint has {len(saved)} optimizer parameter groups, the engine has {len(groups)}")
    for g, opts in zip(groups, saved):
        for k, v in opts.items():
            cur = g.get(k)
            if torch.is_tensor(cur):
                g[k] = torch.full_like(cur, v)
            elif isinstance(cur, tuple) and isinstance(v, list):
                g[k] = tuple(v)
            elif isinstance(v, float) and math.isnan(v) and isinstance(cur, float) and math.isnan(cur):
                continue
            else:
                g[k] = v
