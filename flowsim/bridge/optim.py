"""Optimizers for the bridge: SGD (t = lr × steps matches the flow) and AdamW, the
upper-layer Q/K slow schedule, and Window Smoothing around any torch optimizer.

Window Smoothing replaces each repeated block's update u_l by
u'_l = Σ_l' S[l, l'] u_l' with S = I - (a/2) L_path (flowsim.model.flow.path_smoothing_operator):
(1-a) u_l + (a/2)(u_{l-1} + u_{l+1}) inside, (1-a/2) u_1 + (a/2) u_2 at the ends. Only
the stacks given (same-role, same-shape tensors ordered by depth) are smoothed; the
update smoothed is the base optimizer's, with its weight decay -lr·wd·p taken out first
and left unsmoothed. The norm-preserving variant rescales each u'_l to ‖u_l‖.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flowsim.model.flow import SMOOTHING_VARIANTS, path_smoothing_operator


@dataclass(frozen=True)
class QKSchedule:
    """Learning-rate multiplier of the slowed groups at a step: ρ for the first
    ``hold_fraction`` of ``total_steps``, a linear ramp to 1 over the next ``ramp_fraction``."""

    rho: float
    hold_fraction: float
    ramp_fraction: float
    total_steps: int

    def __post_init__(self) -> None:
        if not self.rho > 0:
            raise ValueError(f"optim.qk_rho must be positive, got {self.rho!r}")
        if not (0 <= self.hold_fraction <= 1 and 0 <= self.ramp_fraction <= 1):
            raise ValueError(f"optim.qk_hold and optim.qk_ramp must be fractions in [0, 1], got "
                             f"{self.hold_fraction!r}, {self.ramp_fraction!r}")

    def __call__(self, step: int) -> float:
        hold = self.hold_fraction * self.total_steps
        ramp = self.ramp_fraction * self.total_steps
        if step < hold:
            return self.rho
        if ramp == 0 or step >= hold + ramp:
            return 1.0
        return self.rho + (1.0 - self.rho) * (step - hold) / ramp


def unit_schedule(step: int) -> float:
    return 1.0


def build_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float, slow: Sequence[str],
                    schedule: QKSchedule | None, momentum: float = 0.0):
    """(optimizer, LambdaLR) with the ``slow`` parameters in their own group on ``schedule``."""
    if not lr > 0:
        raise ValueError(f"optim.lr must be positive, got {lr!r}")
    parameters = dict(model.named_parameters())
    unknown = [name for name in slow if name not in parameters]
    if unknown:
        raise ValueError(f"the Q/K schedule names unknown parameters {unknown}")
    slow_group = [parameters[n] for n in slow] if schedule is not None else []
    rest = [p for n, p in parameters.items() if schedule is None or n not in slow]
    groups = [{"params": rest}] + ([{"params": slow_group}] if slow_group else [])
    if name == "sgd":
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)
    elif name == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
    else:
        raise ValueError(f"optim.name must be 'sgd' or 'adamw', got {name!r}")
    lambdas = [unit_schedule] + ([schedule] if slow_group else [])
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


class WindowSmoothing:
    """Wrap ``base`` so that each ``stacks`` entry (tensors ordered by depth) gets the
    depth-smoothed update. Other tensors get the base update unchanged."""

    def __init__(self, base: torch.optim.Optimizer, stacks: Sequence[Sequence[torch.Tensor]], a: float,
                 variant: str = "standard") -> None:
        if not 0.0 <= a <= 0.5:
            raise ValueError(f"optim.smoothing_a must be in [0, 1/2], got {a!r}")
        if variant not in SMOOTHING_VARIANTS:
            raise ValueError(f"optim.smoothing_variant must be one of {SMOOTHING_VARIANTS}, got {variant!r}")
        for stack in stacks:
            if len(stack) < 2 or len({tuple(p.shape) for p in stack}) != 1:
                raise ValueError("Window Smoothing stacks need at least two tensors of one shape")
        self.base, self.a, self.variant = base, a, variant
        self.stacks = [list(stack) for stack in stacks]

    @property
    def param_groups(self):
        return self.base.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.base.state_dict()

    def load_state_dict(self, state) -> None:
        self.base.load_state_dict(state)

    @torch.no_grad()
    def step(self) -> None:
        # looked up at every step: load_state_dict and schedulers replace the group dicts
        group_of = {id(p): group for group in self.base.param_groups for p in group["params"]}
        before = [[p.detach().clone() for p in stack] for stack in self.stacks]
        self.base.step()

        def decay(p: torch.Tensor, p0: torch.Tensor) -> torch.Tensor:
            return -group_of[id(p)]["lr"] * group_of[id(p)].get("weight_decay", 0.0) * p0

        for stack, old in zip(self.stacks, before):
            operator = torch.as_tensor(path_smoothing_operator(len(stack), self.a), dtype=stack[0].dtype, device=stack[0].device)
            updates = torch.stack([p - p0 - decay(p, p0) for p, p0 in zip(stack, old)])  # decay taken out
            smoothed = torch.einsum("lk,k...->l...", operator, updates)
            if self.variant == "norm_preserving":
                dims = tuple(range(1, updates.dim()))
                old_norm, new_norm = updates.norm(dim=dims, keepdim=True), smoothed.norm(dim=dims, keepdim=True)
                smoothed = smoothed * torch.where(new_norm > 0, old_norm / new_norm.clamp_min(torch.finfo(updates.dtype).tiny), 0.0)
            for p, u, u_smoothed in zip(stack, updates, smoothed):
                p.add_(u_smoothed - u)  # exactly the base step where S = I
