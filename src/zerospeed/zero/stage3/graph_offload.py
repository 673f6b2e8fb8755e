"""DeepCompile's ``offload_activation`` pass: saved activations that a memory plan says must go live in host
memory from the end of the forward to their first use in the backward.

AOTAutograd's partitioner splits the joint graph into a forward graph, whose outputs are the user outputs
followed by the tensors saved for backward, and a backward graph, which takes those saved tensors as
placeholders of the same names. :func:`offload_partition` wraps the partitioner and rewrites both halves:

* the **plan** (:func:`plan_offload`, pure): of the saved activations (intermediate values of static shape that
  are not views), those of at least ``min_bytes`` are eligible; the largest are kept resident while they fit in
  ``budget`` bytes (what every ineligible one costs is counted first), the rest go. DeepSpeed's rule for its
  planned pass (the most bytes not copied per byte of headroom spent), made at compile time from the graph's
  static shapes instead of a profiled run;
* the **forward**: the saved slot of each chosen activation becomes ``zerospeed::act_offload(x)``, placed right
  after the last forward use of ``x``: a host copy (pinned with ``compile.offload_activation_pin_memory`` on
  CUDA), and ``x`` itself dies there (the compiled code drops it after its last use);
* the **backward**: each such placeholder is read through ``zerospeed::act_reload(h)`` (a device copy) placed
  just before its first use; the host copy dies after that.

On a CPU-only machine host and device are the same memory: the pass is exercised (two copies per activation)
but saves nothing there. The budget is :func:`activation_budget`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from .graph_ops import graph_units

MIN_OFFLOAD_BYTES = 5 * 1024 * 1024  # DeepSpeed's floor: below it a copy costs more than the memory it returns
MARGIN = 0.1  # share of device memory left to the allocator


@torch.library.custom_op("zerospeed::act_offload", mutates_args=())
def act_offload(x: torch.Tensor, graph: int, pin: bool) -> torch.Tensor:
    """A host copy of ``x`` (the saved activation the backward will read back)."""
    g = graph_units(graph)
    host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=pin)
    host.copy_(x, non_blocking=pin)
    if pin:
        g.synchronize()  # the copy is done before x can be freed and reused
    g.act_offloads += 1
    g.act_host_bytes += host.numel() * host.element_size()
    g.note("act_offload", -1)
    return host


@act_offload.register_fake
def _act_offload_fake(x: torch.Tensor, graph: int, pin: bool) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@torch.library.custom_op("zerospeed::act_reload", mutates_args=())
def act_reload(host: torch.Tensor, graph: int, device: torch.device) -> torch.Tensor:
    """``host`` back on ``device`` (a copy: on a CPU-only machine too, so the round trip is real)."""
    g = graph_units(graph)
    g.act_reloads += 1
    g.act_host_bytes -= host.numel() * host.element_size()
    g.note("act_reload", -1)
    return torch.empty(host.shape, dtype=host.dtype, device=device).copy_(host)


@act_reload.register_fake
def _act_reload_fake(host: torch.Tensor, graph: int, device: torch.device) -> torch.Tensor:
    return torch.empty(host.shape, dtype=host.dtype, device=device)


OFFLOAD = torch.ops.zerospeed.act_offload.default
RELOAD = torch.ops.zerospeed.act_reload.default


def plan_offload(saved: Sequence[tuple[str, int]], budget: float, min_bytes: int) -> list[str]:
    """The names of the saved activations that go to the host: ``saved`` is (name, bytes) per activation.
    Ineligible ones (under ``min_bytes``) stay and use the budget first; then the largest eligible ones stay
    while they fit; the rest go (in ``saved`` order)."""
    left = budget - sum(n for _, n in saved if n < min_bytes)
    stay: set[str] = set()
    for name, n in sorted((s for s in saved if s[1] >= min_bytes), key=lambda s: -s[1]):
        if n <= left:
            stay.add(name)
            left -= n
    return [name for name, n in saved if n >= min_bytes and name not in stay]


def activation_budget(device_total: int, allocated: int) -> tuple[float, int]:
    """(budget in bytes for the saved activations, the eligibility floor in bytes): the device memory less a
    margin and less what is allocated when the model compiles (its states), or DeepSpeed's test hooks
    ``DS_DC_OFFLOAD_ACT_BUDGET_GB`` (the whole device) and ``DS_DC_OFFLOAD_ACT_MIN_SIZE_MB``."""
    total = float(os.environ.get("DS_DC_OFFLOAD_ACT_BUDGET_GB", 0)) * 1e9 or device_total * (1 - MARGIN)
    floor = os.environ.get("DS_DC_OFFLOAD_ACT_MIN_SIZE_MB")
    return total - allocated, MIN_OFFLOAD_BYTES if floor is None else int(float(floor) * 1024 * 1024)


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or any(not isinstance(d, int) for d in val.shape):
        return -1
    return val.numel() * val.element_size()


def _saved(fw: fx.Graph, num_fwd_outputs: int) -> list[fx.Node]:
    """The forward's saved activations that may move: computed (not inputs), not views, static shapes."""
    out = next(n for n in fw.nodes if n.op == "output")
    saved = out.args[0][num_fwd_outputs:]  # type: ignore[index]
    seen: set[fx.Node] = set()
    keep = []
    for n in saved:
        if isinstance(n, fx.Node) and n not in seen and n.op == "call_function" and _nbytes(n) >= 0 \
                and not getattr(n.target, "is_view", False):
            seen.add(n)
            keep.append(n)
    return keep


def rewrite_forward(fw: fx.Graph, chosen: Sequence[fx.Node], num_fwd_outputs: int, graph: int, pin: bool) -> None:
    """Each chosen node's saved slots become its host copy, made right after its last forward use."""
    out = next(n for n in fw.nodes if n.op == "output")
    order = {n: i for i, n in enumerate(fw.nodes)}
    outs = list(out.args[0])  # type: ignore[arg-type]
    for node in chosen:
        users = [u for u in node.users if u is not out]
        last = max(users, key=order.__getitem__) if users else node
        with fw.inserting_after(last):
            host = fw.call_function(OFFLOAD, (node, graph, pin))
        val = node.meta["val"]
        with val.fake_mode:
            host.meta["val"] = torch.empty(val.shape, dtype=val.dtype, device="cpu")
        outs = [host if i >= num_fwd_outputs and o is node else o for i, o in enumerate(outs)]
    out.args = (tuple(outs),)
    fw.lint()


def rewrite_backward(bw: fx.Graph, names: set[str], devices: dict[str, torch.device], graph: int) -> int:
    """Each placeholder named in ``names`` is read through a reload placed before its first use."""
    order = {n: i for i, n in enumerate(bw.nodes)}
    done = 0
    for ph in [n for n in bw.nodes if n.op == "placeholder" and n.name in names and n.users]:
        first = min(ph.users, key=order.__getitem__)
        with bw.inserting_before(first):
            back = bw.call_function(RELOAD, (ph, graph, devices[ph.name]))
        back.meta.update(ph.meta)
        ph.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
        done += 1
    bw.lint()
    return done


def offload_partition(partition_fn: Any, graph: int, budget: float, min_bytes: int, pin: bool,
                      plans: list[dict[str, list[tuple[str, int]]]]) -> Any:
    """``partition_fn`` (AOTAutograd's) followed by the pass; ``plans`` receives each graph's plan: the saved
    activations (name, bytes) ``moved`` to the host and ``kept``."""

    def partition(joint: fx.GraphModule, joint_inputs: Any, *args: Any, num_fwd_outputs: int, **kwargs: Any) -> Any:
        fw, bw = partition_fn(joint, joint_inputs, *args, num_fwd_outputs=num_fwd_outputs, **kwargs)
        in_bw = {n.name for n in bw.graph.nodes if n.op == "placeholder"}
        saved = [n for n in _saved(fw.graph, num_fwd_outputs) if n.name in in_bw]
        names = set(plan_offload([(n.name, _nbytes(n)) for n in saved], budget, min_bytes))
        chosen = [n for n in saved if n.name in names]
        devices = {n.name: n.meta["val"].device for n in chosen}
        rewrite_forward(fw.graph, chosen, num_fwd_outputs, graph, pin)
        rewrite_backward(bw.graph, names, devices, graph)
        fw.recompile()
        bw.recompile()
        plans.append({"moved": [(n.name, _nbytes(n)) for n in chosen],
                      "kept": [(n.name, _nbytes(n)) for n in saved if n.name not in names]})
        return fw, bw

    return partition


__all__ = ["activation_budget", "act_offload", "act_reload", "offload_partition", "plan_offload",
           "rewrite_backward", "rewrite_forward"]
