"""The MoE layer (DeepSpeed's ``deepspeed.moe.layer.MoE``): route, dispatch, run experts, combine.

``MoE(hidden_size, expert, num_experts, ep_size, k, ...)`` holds ``num_experts // ep_size`` local copies of
``expert``; the expert-parallel rank ``p`` holds global experts ``[p * E_local, (p + 1) * E_local)``. Forward
(GShard's algorithm 2)::

    tokens [S, M] --gate--> routes --encode--> [E, C, M] --all-to-all--> local experts --all-to-all--> decode

No communication at ``ep_size == 1``; otherwise one capacity all-gather (an int per rank) and two
all-to-alls. Returns ``(output, l_aux, exp_counts)`` as DeepSpeed does.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from .dispatch import decode, encode, run_experts_parallel
from .experts import Experts
from .gate import NOISY_GATE_POLICIES, TopKGate
from .groups import ExpertGroups, create_expert_groups, group_name
from .tensor_parallel import TensorParallel, tensor_parallel_of


class MOELayer(nn.Module):
    """Gate + experts + dispatch. ``ep_group`` is set by :meth:`MoE.set_deepspeed_parallelism`."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int,
                 use_tutel: bool = False) -> None:
        super().__init__()
        if use_tutel:
            raise NotImplementedError("use_tutel (Tutel kernels) is not supported yet by zerospeed")
        self.gate = gate
        self.experts = experts
        self.ep_group: Any = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.l_aux: Tensor | None = None
        self.exp_counts: Tensor | None = None
        self.tp: TensorParallel | None = None  # expert tensor parallelism (set with the groups)

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group
        self.gate.ep_group = ep_group

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        hidden = input[0]
        used_token = input[1] if len(input) > 1 else None
        d_model = hidden.shape[-1]
        tokens = hidden.reshape(-1, d_model)
        routes = self.gate.route(tokens, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        buf = encode(tokens, routes.expert, routes.location, routes.num_experts, routes.capacity)
        if self.ep_size > 1:
            if self.ep_group is None:
                raise RuntimeError("MoE with ep_size > 1 has no expert-parallel group: call "
                                   "set_deepspeed_parallelism() or pass the model to zerospeed.initialize()")
            out = run_experts_parallel(buf, self.experts, self.ep_group, self.ep_size, self.tp)
        else:
            e, c, m = buf.shape
            out = self.experts(buf.unsqueeze(0)).reshape(e, c, m)
        return decode(out, routes.expert, routes.location, routes.gate).reshape(hidden.shape)


class MoE(nn.Module):
    """DeepSpeed's MoE layer; same arguments, same defaults, same ``(output, l_aux, exp_counts)`` result."""

    autoep = False  # not an AutoEP layer (those fold over AutoTP's tensor group)

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"Number of experts ({num_experts}) should be divisible by expert parallel size "
                             f"({ep_size})")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"Unsupported noisy_gate_policy: {noisy_gate_policy!r}")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts,
                                      use_tutel=use_tutel)
        self.expert_groups: ExpertGroups | None = None
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False,
                                  registry: dict[str, ExpertGroups] | None = None, mpu: Any = None) -> None:
        """Create (or take from ``registry``) this layer's expert groups, inside the data-parallel groups of
        ``mpu``'s grid when given (a pipeline's, or a tensor-parallel one). Collective over the world."""
        tp = tensor_parallel_of(mpu)
        if tp is not None and not self.enable_expert_tensor_parallelism:
            raise NotImplementedError("MoE layers with tensor parallelism but experts that are not tensor-parallel "
                                      "are not supported yet by zerospeed; build the MoE layer with "
                                      "enable_expert_tensor_parallelism=True (experts split over the tensor group)")
        self.expert_groups = create_expert_groups(self.ep_size, use_data_before_expert_parallel_, registry, mpu)
        self.deepspeed_moe._set_ep_group(self.expert_groups.ep_group)
        self.deepspeed_moe.tp = tp
        for m in self.deepspeed_moe.experts.modules():  # split expert layers get their tensor-parallel group
            if tp is not None and hasattr(m, "set_tensor_parallel_group"):
                m.set_tensor_parallel_group(tp.group)

    def expert_parameters(self) -> list[nn.Parameter]:
        return list(self.deepspeed_moe.experts.parameters())

    @property
    def expert_tp(self) -> TensorParallel | None:
        return self.deepspeed_moe.tp

    def global_expert_ids(self) -> list[int]:
        """Global ids of this rank's local experts (expert-parallel rank p holds ``p*E_local ...``)."""
        p = self.expert_groups.ep_rank if self.expert_groups is not None else 0
        return list(range(p * self.num_local_experts, (p + 1) * self.num_local_experts))

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            mlp = self.mlp(hidden_states)
            mlp = mlp[0] if isinstance(mlp, tuple) else mlp
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
