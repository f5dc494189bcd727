"""Whether ``convert`` may swap a module for a lowprec layer: the layer computes one known forward from the
module's own parameters alone, so anything else the module does or holds would be lost."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils import parametrize


def replacement_blocker(
    module: torch.nn.Module,
    forward: Callable,
    needs: tuple[str, ...],
    may_hold: tuple[str, ...] = (),
    override_hint: str = "",
) -> str | None:
    """Why ``module`` cannot become a layer that computes ``forward`` from what it holds (parameters, buffers and
    children by name): ``needs`` all of, ``may_hold`` any of, nothing else; None if it can. ``override_hint``
    follows the reason given for a class that overrides ``forward`` (how to convert it anyway)."""
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        return "uninitialized lazy layer: run a forward pass before converting"
    if parametrize.is_parametrized(module):
        return "parametrized (torch.nn.utils.parametrize): its weights are computed at each forward"
    if "forward" in vars(module):
        return "its forward is replaced on the instance"
    if type(module).forward is not forward:
        return f"{type(module).__name__} overrides forward{override_hint}"
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks:
        return "has hooks registered, which the converted layer would not run"
    held = [name for name, _ in module.named_parameters(recurse=False)]
    held += [name for name, _ in module.named_buffers(recurse=False)]
    held += [name for name, _ in module.named_children()]
    extra = [name for name in held if name not in needs + may_hold]
    if extra:
        return f"holds more than {_listed(needs + may_hold)} ({', '.join(extra)}), which the converted layer would drop"
    missing = [name for name in needs if name not in held]
    if missing:
        return f"lacks {_listed(tuple(missing))}, which the converted layer computes with"
    return None


def _listed(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
