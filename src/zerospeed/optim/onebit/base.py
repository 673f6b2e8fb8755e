"""What DeepSpeed's 1-bit optimizers share: the data-parallel group, error buffers, the momentum mask.

The error buffers of the compressed all-reduce (``comm.compressed``) are per rank and padded, so they are
kept beside ``optimizer.state``, not in it: checkpoints never carry them, and they are dropped whenever a
parameter's state is replaced (a checkpoint load, by ``load_state_dict`` or the engine) -- DeepSpeed resets
them on load too (each rank's errors differ, and they only fit the same world size).
"""

from __future__ import annotations

from collections.abc import Iterator

from typing import Any

import torch

from ... import comm

COMM_BACKENDS = ("nccl", "mpi", "hccl", "compressed")  # DeepSpeed's names; all run over zerospeed.comm


class CompressedOptimizer(torch.optim.Optimizer):
    """Base of the optimizers that exchange compressed momentum themselves.

    ``compresses_communication`` tells the engine builder to hand the gradient all-reduce over to
    :meth:`wants_backward_allreduce` (DeepSpeed's ``engine.enable_backward_allreduce``) and to bind the
    data-parallel group with :meth:`bind`.
    """

    compresses_communication = True
    deepspeed_name = "?"  # the name in DeepSpeed's "not compatible with ZeRO" message

    def __init__(self, params: Any, defaults: dict[str, Any], deepspeed: Any, comm_backend_name: str,
                 amsgrad: bool, eps_inside_sqrt: bool = False, cuda_aware: bool = False) -> None:
        if amsgrad:
            raise ValueError(f"{self.deepspeed_name} does not support the AMSGrad variant (as in DeepSpeed)")
        if comm_backend_name not in COMM_BACKENDS:
            raise ValueError(f"comm_backend_name must be one of {list(COMM_BACKENDS)}, got {comm_backend_name!r}")
        super().__init__(params, defaults)
        self.comm_backend_name = comm_backend_name
        self.eps_mode = 0 if eps_inside_sqrt else 1  # DeepSpeed's attribute
        self.cuda_aware = cuda_aware  # accepted, as in DeepSpeed; comm/ chooses the transport
        self.deepspeed = deepspeed
        mpu = getattr(deepspeed, "mpu", None)
        self.group: comm.Group | None = mpu.get_data_parallel_group() if mpu is not None else None
        self._errors: dict[torch.Tensor, tuple[dict[str, Any], torch.Tensor, torch.Tensor]] = {}

    @property
    def initialize(self) -> bool:
        """DeepSpeed's flag: true once the initialising first call has happened."""
        return self.first_step_count() > 0

    def bind(self, group: comm.Group | None) -> None:
        """Exchange over ``group`` (the engine's data-parallel group; None: the default group)."""
        self.group = group

    def world_size(self) -> int:
        return comm.get_world_size(self.group) if comm.is_initialized() else 1

    def wants_backward_allreduce(self) -> bool:
        """Whether the engine should all-reduce the gradients before the next step."""
        raise TypeError(f"{type(self).__name__} must define wants_backward_allreduce() (a compressing optimizer "
                        "decides when the engine all-reduces gradients)")

    def _with_grads(self, name: str) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        """(group, parameter) for every parameter holding a dense gradient (sparse ones are refused)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{name} does not support sparse gradients")
                yield group, p

    def first_step_count(self) -> int:
        """``state['step']`` of the first parameter that has a state (0 before any step)."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" in state:
                    return int(state["step"])
        return 0

    def error_buffers(self, p: torch.Tensor, numel: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(worker_error, server_error) kept for ``p`` (of ``numel`` elements, default p's): zeros when new
        or when p's state was replaced."""
        state = self.state[p]
        held = self._errors.get(p)
        numel = p.numel() if numel is None else numel
        if held is None or held[0] is not state or comm.padded_numel(numel, self.world_size()) != held[1].numel():
            we, se = comm.error_buffers(numel, self.world_size(), p.device)
            held = (state, we, se)
            self._errors[p] = held
        return held[1], held[2]

    def reset_errors(self) -> None:
        self._errors.clear()

    def compressed_average(self, group: dict[str, Any], p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The 1-bit average of ``t`` over the group (``t`` itself at world 1), times ``exp_avg_mask``."""
        if self.world_size() > 1:
            we, se = self.error_buffers(p)
            t = comm.compressed_all_reduce(t, we, se, self.group)
        return apply_mask(group, t)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """DeepSpeed's rules: keep this optimizer's ``exp_avg_mask`` (never the checkpoint's), reset errors."""
        groups = state_dict["param_groups"]
        for i, group in enumerate(self.param_groups):
            if "exp_avg_mask" in group:
                groups[i]["exp_avg_mask"] = group["exp_avg_mask"]
            else:
                groups[i].pop("exp_avg_mask", None)
        super().load_state_dict(state_dict)
        self.reset_errors()


def apply_mask(group: dict[str, Any], t: torch.Tensor) -> torch.Tensor:
    """Multiply by the group's ``exp_avg_mask`` when it has one (1-bit signs cannot encode exact zeros)."""
    mask = group.get("exp_avg_mask")
    if mask is None:
        return t
    if mask.device != t.device:
        group["exp_avg_mask"] = mask = mask.to(t.device)
    return t.mul_(mask)
