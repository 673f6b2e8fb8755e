"""Mixture of Experts with expert parallelism: routing (pure), the MoE layer, expert groups on the topology."""

from .gate import TopKGate
from .gating import Routing, capacity_for, multiplicative_jitter, top1gating, top2gating, topkgating

__all__ = ["Routing", "TopKGate", "capacity_for", "multiplicative_jitter", "top1gating", "top2gating", "topkgating"]
