"""``lowprec.convert``: make any PyTorch model's linear layers FP8-capable and debuggable, and say which.

A converted layer shares the original's Parameters and is named by its module path, which is what
debug configs select. Modules that hold GEMMs but cannot be converted are reported, not silently
kept in high precision.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch

from lowprec.errors import LowprecTypeError, LowprecValueError
from lowprec.modules.base import NamedModule
from lowprec.modules.conv1d import Conv1D
from lowprec.modules.high_precision_gemms import FILTERED_OUT, register_converted
from lowprec.modules.linear import Linear
from lowprec.modules.moe import moe_plan
from lowprec.modules.replaceable import replacement_blocker
from nvdlfw_inspect.logging import say_once
from nvdlfw_inspect.regex_safety import SAFE_FORMS, backtracks

logger = logging.getLogger("lowprec")

ModuleFilter = Callable[[str, torch.nn.Module], bool]

# GEMM-bearing modules lowprec has no layer for; each is reported with its reason.
_NOT_CONVERTED: tuple[tuple[type | tuple[type, ...], str], ...] = (
    (
        torch.nn.MultiheadAttention,
        "its projections run in F.multi_head_attention_forward, which reads the weights directly",
    ),
    (
        (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d),
        "convolution: lowprec has no FP8 convolution",
    ),
    (
        (torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d),
        "transposed convolution: lowprec has no FP8 convolution",
    ),
    (torch.nn.Bilinear, "bilinear layer: lowprec has no FP8 bilinear layer"),
    (
        (torch.nn.RNNBase, torch.nn.RNNCellBase),
        "recurrent layer: its GEMMs run inside torch's RNN kernels",
    ),
)


# Linear layers that override ``forward`` with ``x @ weight.T + bias`` (a plain linear layer in other words),
# by module and qualified name, so that they are recognised without importing their library.
KNOWN_PLAIN_LINEARS: frozenset[str] = frozenset(
    {
        "transformers.models.falcon.modeling_falcon.FalconLinear",
    }
)


class Skipped(NamedTuple):
    """A module left in high precision: its path in the model, its type name and why."""

    path: str
    type_name: str
    reason: str


@dataclass
class ConvertReport:
    """What ``convert_with_report`` did: the model to use from now on, the debug names of the layers
    it converted, and the modules it left in high precision (``reason == "filtered out"`` when the
    user's filter kept them), named in messages like the converted ones (``name``)."""

    model: torch.nn.Module
    converted: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    prefix: str = "model"

    def name(self, path: str) -> str:
        """The name of the module at ``path``: ``{prefix}.{path}``, as converted layers are named (``<root>`` for the
        model itself without a prefix)."""
        return ".".join(part for part in (self.prefix, path) if part) or "<root>"

    def __str__(self) -> str:
        lines = [f"lowprec.convert: {len(self.converted)} layers converted, {len(self.skipped)} modules left in high precision"]
        lines += [f"  converted {name}" for name in self.converted]
        lines += [f"  skipped {self.name(s.path)} ({s.type_name}): {s.reason}" for s in self.skipped]
        return "\n".join(lines)


def convert(
    model: torch.nn.Module,
    prefix: str = "model",
    *,
    module_filter_fn: ModuleFilter | None = None,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    plain_linears: Sequence[type] = (),
) -> torch.nn.Module:
    """Convert ``model``'s linear layers in place (see ``convert_with_report``) and return the model to use.

    A bare layer passed in is returned converted. Conversions and the modules the filters kept are logged to the
    ``lowprec`` logger (INFO); GEMM-bearing modules left in high precision (and converting no layer) are said once
    in the debug log and as a warning, each module named as a converted one would be, with the reason.
    """
    return convert_with_report(
        model, prefix, module_filter_fn=module_filter_fn, include=include, exclude=exclude, plain_linears=plain_linears
    ).model


def convert_with_report(
    model: torch.nn.Module,
    prefix: str = "model",
    *,
    module_filter_fn: ModuleFilter | None = None,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    plain_linears: Sequence[type] = (),
) -> ConvertReport:
    """Replace ``torch.nn.Linear`` (and subclasses keeping its forward) by ``lowprec.Linear`` and Hugging
    Face ``Conv1D`` by ``lowprec.Conv1D``, each sharing the original's Parameters and named
    ``{prefix}.{path}``.

    A module at ``path`` (``"transformer.h.0.attn.c_attn"``; ``""`` for ``model`` itself) is converted
    only if ``module_filter_fn(path, module)`` returns True, some ``include`` regex (``re.search``)
    matches ``path`` and no ``exclude`` regex does: ``exclude="lm_head"`` keeps the head in high precision.

    ``plain_linears`` names classes that override ``forward`` but compute ``x @ weight.T + bias`` from a
    2-D ``weight`` of shape ``(out, in)`` and an optional ``bias``, so that they are converted like
    ``torch.nn.Linear`` (a class need not be one); ``KNOWN_PLAIN_LINEARS`` (Falcon's ``FalconLinear``)
    are recognised without being named.
    """
    if not isinstance(model, torch.nn.Module):
        raise LowprecTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(prefix, str):
        raise LowprecTypeError(f"prefix must be a string, got {prefix!r}")
    selection = _Selection(module_filter_fn, _patterns("include", include), _patterns("exclude", exclude))
    report = ConvertReport(model, prefix=prefix)
    report.model = _Converter(selection, _plain_classes(plain_linears), report).visit(model, "")
    _log(report)
    register_converted(report.model, prefix, {report.name(s.path): (s.type_name, s.reason) for s in report.skipped})
    return report


def _plain_classes(value: Sequence[type]) -> frozenset[type]:
    """``plain_linears`` checked: a list or tuple of classes of ``torch.nn.Module``."""
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(cls, type) and issubclass(cls, torch.nn.Module) for cls in value
    ):
        raise LowprecTypeError(
            f"plain_linears must be a list of torch.nn.Module classes whose forward computes x @ weight.T + bias, got {value!r}"
        )
    return frozenset(value)


def _patterns(arg: str, value: str | Sequence[str] | None) -> list[re.Pattern[str]] | None:
    """``value`` compiled: one regex or a non-empty list of them; None selects every path."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) for item in items):
        raise LowprecTypeError(f"{arg} must be a regex string or a list of regex strings, got {value!r}")
    if not items:
        raise LowprecValueError(f"{arg} must hold at least one regex, got {value!r}; pass None to select every module")
    compiled = []
    for item in items:
        try:
            compiled.append(re.compile(item))
        except re.error as err:
            raise LowprecValueError(f"{arg}: {item!r} is not a valid regular expression ({err})") from None
        if backtracks(item):  # convert searches every module path with it: a hang, not an error, otherwise
            raise LowprecValueError(f"{arg}: {item!r} can take time that explodes with a path's length; use {SAFE_FORMS}")
    return compiled


class _Selection:
    """The user's choice of modules to convert: a callable and include / exclude regexes on the path."""

    def __init__(
        self,
        fn: ModuleFilter | None,
        include: list[re.Pattern[str]] | None,
        exclude: list[re.Pattern[str]] | None,
    ):
        if fn is not None and not callable(fn):
            raise LowprecTypeError(f"module_filter_fn must be callable as fn(path, module) -> bool, got {fn!r}")
        self.fn, self.include, self.exclude = fn, include, exclude

    def keeps(self, path: str, module: torch.nn.Module) -> bool:
        if self.include is not None and not any(p.search(path) for p in self.include):
            return False
        if self.exclude is not None and any(p.search(path) for p in self.exclude):
            return False
        if self.fn is None:
            return True
        chosen = self.fn(path, module)
        if not isinstance(chosen, bool):
            raise LowprecTypeError(f"module_filter_fn must return a bool, got {chosen!r} for path {path!r}")
        return chosen


class _Converter:
    """One walk over a model, converting in place and filling ``report``."""

    def __init__(self, selection: _Selection, plain_linears: frozenset[type], report: ConvertReport):
        self.selection, self.plain_linears, self.report = selection, plain_linears, report
        self.done: dict[int, torch.nn.Module] = {}  # a module registered twice is handled once

    def visit(self, module: torch.nn.Module, path: str) -> torch.nn.Module:
        """What belongs at ``path``: ``module`` converted, or ``module`` itself with its children visited."""
        if id(module) not in self.done:
            self.done[id(module)] = self._convert(module, path)
        return self.done[id(module)]

    def _convert(self, module: torch.nn.Module, path: str) -> torch.nn.Module:
        plan = _plan(module, self.plain_linears)
        if callable(plan):
            if self.selection.keeps(path, module):
                name = self.report.name(path)
                self.report.converted.append(name)
                return plan(name).train(module.training)
            plan = FILTERED_OUT
        if plan is not None:
            self.report.skipped.append(Skipped(path, type(module).__name__, plan))
        if not isinstance(module, (NamedModule, torch.nn.MultiheadAttention)):
            for child_name, child in list(module._modules.items()):  # named_children() hides a second registration
                if child is None:
                    continue
                new = self.visit(child, f"{path}.{child_name}" if path else child_name)
                if new is not child:
                    setattr(module, child_name, new)
        return module


def _plan(module: torch.nn.Module, plain_linears: frozenset[type]) -> Callable[[str], NamedModule] | str | None:
    """How to convert ``module``: a factory taking the layer name, the reason a GEMM-bearing module
    stays as it is, or None for modules without a GEMM of their own (and lowprec layers)."""
    if isinstance(module, NamedModule):
        return None
    plain_forward = _plain_forward(module, plain_linears)
    if plain_forward is not None:
        return _plain_blocker(module) or _blocker(module, plain_forward) or partial(_linear_sharing, module)
    if isinstance(module, torch.nn.Linear):
        return _blocker(module, torch.nn.Linear.forward) or partial(Linear.from_torch, module)
    hf_class = _hf_conv1d_class(module)
    if hf_class is not None:
        return _blocker(module, hf_class.forward) or partial(Conv1D.from_hf, module)
    for types, reason in _NOT_CONVERTED:
        if isinstance(module, types):
            return reason
    return moe_plan(module)  # Hugging Face experts and routers; any other module holding 3-D weights is reported


def _plain_forward(module: torch.nn.Module, plain_linears: frozenset[type]) -> Callable | None:
    """The forward of the class that gives ``module`` its forward, if that class is a declared (or known)
    plain linear layer."""
    for cls in type(module).__mro__:
        if "forward" in vars(cls):
            known = f"{cls.__module__}.{cls.__qualname__}" in KNOWN_PLAIN_LINEARS
            return cls.forward if cls in plain_linears or known else None
    return None


def _plain_blocker(module: torch.nn.Module) -> str | None:
    """Why a declared plain linear layer has not the parameters of one."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2:
        return "declared a plain linear layer, but has no 2-D weight Parameter"
    if bias is not None and (not isinstance(bias, torch.nn.Parameter) or bias.shape != weight.shape[:1]):
        return f"declared a plain linear layer, but its bias is not a Parameter of shape ({weight.shape[0]},)"
    return None


def _linear_sharing(module: torch.nn.Module, name: str) -> Linear:
    """A ``lowprec.Linear`` sharing the weight and bias of a plain linear layer of another class."""
    out_features, in_features = module.weight.shape
    return Linear.sharing(in_features, out_features, module.weight, module.bias, name)


def _hf_conv1d_class(module: torch.nn.Module) -> type | None:
    """Hugging Face's ``Conv1D`` if ``module`` is one (found without importing ``transformers``)."""
    for cls in type(module).__mro__:
        if cls.__name__ == "Conv1D" and cls.__module__.partition(".")[0] == "transformers":
            return cls
    return None


def _blocker(module: torch.nn.Module, forward: Callable) -> str | None:
    """Why ``module`` cannot become a layer that computes ``forward`` from its weight and bias alone."""
    name = type(module).__name__
    hint = f"; if it computes x @ weight.T + bias, convert it with plain_linears=[{name}]"
    return replacement_blocker(module, forward, ("weight",), ("bias",), override_hint=hint)


def _log(report: ConvertReport) -> None:
    """Conversions and the user's filtering to the ``lowprec`` logger (INFO); no layer converted, and the modules
    left in high precision with the reason, said once (debug log and warning)."""
    converted, skipped = report.converted, report.skipped
    if converted:
        logger.info("lowprec.convert: converted %d layers: %s", len(converted), ", ".join(converted))
    else:
        say_once("lowprec.convert: converted no layer", call_site=__name__)
    filtered = [report.name(s.path) for s in skipped if s.reason == FILTERED_OUT]
    if filtered:
        logger.info("lowprec.convert: filtered out (kept in high precision): %s", ", ".join(filtered))
    blocked = [s for s in skipped if s.reason != FILTERED_OUT]
    if blocked:
        say_once(
            f"lowprec.convert: left {len(blocked)} modules with GEMMs in high precision: "
            + "; ".join(f"{report.name(s.path)} ({s.type_name}): {s.reason}" for s in blocked),
            call_site=__name__,
        )
