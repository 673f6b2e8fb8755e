"""DeepCompile's state offloads at ZeRO-3: optimizer states and parameter shards on the host (``compile.offload_*``).

* ``offload_opt_states`` (DeepSpeed's ``offload_adam_states``, its synchronous schedule):
  :class:`OptStateOffload` moves every tensor of the optimizer's state (Adam's ``exp_avg`` and ``exp_avg_sq``;
  not the scalar ``step``) into a host buffer (pinned on CUDA) at the head of each training forward, dropping
  the device copy, and brings it back in a fresh device buffer just before the optimizer steps (a step
  pre-hook of the torch optimizer, public API). So the states are off the accelerator for the whole forward
  and backward, and on it for the step. The fp32 master stays: at fp32 compute a partitioned parameter's
  shard *is* its master slot (``zero/stage3/group.py``) and the graph's gathers read it. The first step has
  no state yet, so offloading engages from the second forward on (as in DeepSpeed).
* ``offload_parameters``: :func:`home_shards` gives every partitioned parameter shard that has no home a host
  home (``offload/param_home.ParamHome``, device ``cpu``: zerospeed's ZeRO-Infinity parameter offload, pinned
  on CUDA), so DeepCompile's gathers read the shards from the host and the optimizer's write-back stores them
  there. Under ``zero_optimization.offload_param`` the shards already live in their home and nothing changes.

On a CPU-only machine host and device are the same memory: both are exercised (copies, homes) but save
nothing there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..accelerator import can_pin_memory


class OptStateOffload:
    """The optimizer's state tensors, on the host between the head of a forward and the next step."""

    def __init__(self, optimizer: torch.optim.Optimizer, pin: bool = True) -> None:
        self.optimizer = optimizer
        self.pin = pin and can_pin_memory()
        self.host: dict[tuple[int, str], torch.Tensor] = {}  # (id of the param, key) -> host buffer
        self.device: dict[tuple[int, str], torch.device] = {}
        self.on_host = False
        self.offloads = 0  # offload() calls that moved something
        self.reloads = 0
        self._hook = optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.reload())

    def _tensors(self) -> Iterable[tuple[tuple[int, str], dict[str, Any], str]]:
        for p, st in self.optimizer.state.items():
            for k, v in st.items():
                if torch.is_tensor(v) and v.numel() > 1:
                    yield (id(p), k), st, k

    @torch.no_grad()
    def offload(self) -> None:
        """Every state tensor to its host buffer; the device copy is dropped."""
        if self.on_host:
            return
        moved = 0
        for key, st, k in self._tensors():
            v = st[k]
            buf = self.host.get(key)
            if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
                buf = self.host[key] = torch.empty(v.shape, dtype=v.dtype, device="cpu", pin_memory=self.pin)
            buf.copy_(v)
            self.device[key] = v.device
            st[k] = buf
            moved += 1
        if moved:
            self.on_host = True
            self.offloads += 1

    @torch.no_grad()
    def reload(self) -> None:
        """Every state tensor back on its device, in a fresh buffer (the host buffers stay for the next time)."""
        if not self.on_host:
            return
        for key, st, k in self._tensors():
            if st[k] is self.host.get(key):
                st[k] = torch.empty(st[k].shape, dtype=st[k].dtype, device=self.device[key]).copy_(st[k])
        self.on_host = False
        self.reloads += 1

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())

    def close(self) -> None:
        self.reload()
        self._hook.remove()


def home_shards(shards: Iterable[Any], rank: int) -> Any:
    """Give every partitioned shard without a home a host one; returns the new home (None: nothing to do)."""
    from ..config.offload import AioConfig, OffloadParamConfig
    from ..offload.param_home import ParamHome

    todo = [s for s in shards if s.local is not None and s.home is None]
    if not todo:
        return None
    home = ParamHome(OffloadParamConfig(device="cpu", pin_memory=True), AioConfig(), rank)
    for s in todo:
        home.adopt(s)
    return home


__all__ = ["OptStateOffload", "home_shards"]
