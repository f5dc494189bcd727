"""GEMMs that stay in high precision under ``lowprec.autocast`` without anything saying so: a tied head
``h @ self.emb.weight.T``, ``x @ self.W``, ``F.linear(x, self.weight)``, the projections of a module ``convert``
skipped (``nn.MultiheadAttention``). No lowprec layer runs them, so no routing record, no statistic and no line
of ``convert``'s report would name them.

Looked for once per debug session (and once without one), at the first forwards under an autocast: global module
hooks note which module runs, and while a top-level module runs its forward a dispatch mode follows every
``nn.Parameter`` through views and casts to the GEMMs that read it outside a lowprec layer. Each such Parameter
is said once (debug log and warning) with the fix, and gets routing records (high precision, with the reason),
as does each module ``convert`` skipped in a model that ran; an autocast in which no lowprec layer ran says so.
The watch ends at the autocast's exit or when a top-level module runs a second forward; later steps pay nothing.
It follows the thread that entered the autocast (the recipe in force is per thread): forwards of other threads,
which run under their own autocast or none, are not its.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

import nvdlfw_inspect.api as debug_api
from lowprec.autocast import active_recipe, set_entry_watch
from lowprec.debug.names import INPUT_TENSORS, TENSOR_GEMMS
from lowprec.modules.base import NamedModule
from nvdlfw_inspect.logging import say_once

aten = torch.ops.aten
#: operators that multiply by a weight, each with the positions of its factors (not the added bias): what a
#: lowprec layer would run in FP8 (convolutions and fused attention: what it cannot)
GEMMS: dict[Any, tuple[int, ...]] = {
    aten.mm: (0, 1),
    aten.bmm: (0, 1),
    aten.mv: (0, 1),
    aten.dot: (0, 1),
    aten.vdot: (0, 1),
    aten.addmm: (1, 2),
    aten.addbmm: (1, 2),
    aten.baddbmm: (1, 2),
    aten.addmv: (1, 2),
    aten._addmm_activation: (1, 2),
    aten.convolution: (0, 1),
    aten._native_multi_head_attention: (0, 1, 2, 5, 7),  # query, key, value, qkv_weight, proj_weight
}
#: operators whose output is their input in another dtype or layout (views are found by ``is_view``)
COPIES = frozenset({aten._to_copy, aten.clone, aten._unsafe_view})
DEFAULT_PREFIX = "model"  # the name ``convert`` and ``infer_and_assign_layer_names`` give a model
FILTERED_OUT = "filtered out"  # the reason of a module ``convert``'s filters kept: the user's choice, not warned about


@dataclass(frozen=True)
class Converted:
    """What ``convert`` said of a model: the prefix of its layer names and the modules it skipped, by name."""

    prefix: str
    skipped: dict[str, tuple[str, str]]  # name -> (type name, reason)


_converted: weakref.WeakKeyDictionary[torch.nn.Module, Converted] = weakref.WeakKeyDictionary()


def register_converted(model: torch.nn.Module, prefix: str, skipped: dict[str, tuple[str, str]]) -> None:
    """Remember a model ``convert`` returned, so the watch names its Parameters as ``convert`` names its layers and
    gives the modules it skipped routing records when the model runs."""
    _converted[model] = Converted(prefix, skipped)


class _Sessions:
    """The debug sessions (and the time without one) that were watched already."""

    def __init__(self) -> None:
        self.sessionless = False
        self.last: weakref.ref | None = None

    def due(self) -> bool:
        manager = debug_api.DEBUG_MANAGER
        if manager is None:
            return not self.sessionless
        return self.last is None or self.last() is not manager

    def done(self) -> None:
        manager = debug_api.DEBUG_MANAGER
        if manager is None:
            self.sessionless = True
        else:
            self.last = weakref.ref(manager)


_sessions = _Sessions()
_watching = False


def watch_autocast() -> Callable[[], None] | None:
    """At an autocast's entry: start the watch when it is due; what to call at the autocast's exit."""
    global _watching
    if _watching or not _sessions.due():
        return None
    _watching = True
    return _Watch().finish


class _Watch:
    """One watch: the module hooks, the Parameter each tensor seen comes from, and the GEMMs found."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()  # the module hooks are global: other threads' forwards are not watched
        self.hooks = [
            register_module_forward_pre_hook(self._before),
            register_module_forward_hook(self._after, always_call=True),
        ]
        self.running: list[torch.nn.Module] = []  # the modules whose forward is under way, outermost first
        self.mode: _ParameterReads | None = None
        self.roots: dict[int, torch.nn.Module] = {}  # the top-level modules that ran, by id
        self.ran: list[torch.nn.Module] = []  # the converted models that ran
        self.lowprec_depth = 0  # lowprec layers under way: their GEMMs are theirs
        self.lowprec_ran = False
        self.blind = False  # a compiled module ran: the mode could not look inside it
        self.found: dict[int, tuple[torch.nn.Parameter, str]] = {}  # Parameter id -> (Parameter, operator)
        self.finished = False

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or threading.get_ident() != self.thread:
            return
        if not self.running:
            if id(module) in self.roots:  # a second forward: the first one was seen whole
                self.finish()
                return
            self.roots[id(module)] = module
            if hasattr(module, "_orig_mod"):  # torch.compile's wrapper: dynamo runs it, not this mode
                self.blind = True
            else:
                self.mode = _ParameterReads(self)
                self.mode.__enter__()
        self.running.append(module)
        if module in _converted:
            self.ran.append(module)
        if isinstance(module, NamedModule):
            self.lowprec_depth += 1
            self.lowprec_ran = True

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or threading.get_ident() != self.thread:
            return
        if not self.running or self.running[-1] is not module:
            return
        self.running.pop()
        if isinstance(module, NamedModule):
            self.lowprec_depth -= 1
        if not self.running and self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None

    def read(self, parameter: torch.nn.Parameter, op: str) -> None:
        """``op`` read ``parameter`` (or a view or cast of it) in high precision: noted, if outside a lowprec layer
        while a recipe is in force."""
        if self.lowprec_depth == 0 and id(parameter) not in self.found and active_recipe() is not None:
            self.found[id(parameter)] = (parameter, op)

    def finish(self) -> None:
        """The end of the watch: the hooks removed, what was found said and recorded."""
        global _watching
        if self.finished:
            return
        self.finished = True
        _watching = False
        for hook in self.hooks:
            hook.remove()
        if not self.roots:
            return  # no module ran: the next autocast watches
        _sessions.done()
        names = self._names()
        skipped = {name: entry for model in self.ran for name, entry in _converted[model].skipped.items()}
        for name, (_, reason) in skipped.items():
            _record(name, "filtered out of lowprec.convert" if reason == FILTERED_OUT else f"not converted: {reason}")
        in_skipped: dict[str, list[str]] = {}  # skipped module -> "op on parameter" of each GEMM that read one
        stray: list[tuple[str, str]] = []  # (name, op) of the other Parameters read
        for parameter, op in self.found.values():
            name = names.get(id(parameter)) or f"<parameter {tuple(parameter.shape)}>"
            holder = next((module for module in skipped if name.startswith(f"{module}.")), None)
            if holder is None:
                stray.append((name, op))
                _record(name, f"not in a lowprec layer: {op}")
            else:
                in_skipped.setdefault(holder, []).append(f"{op} on {name[len(holder) + 1 :]}")
        for holder, reads in in_skipped.items():
            _say_skipped_ran(holder, *skipped[holder], reads)
        if self.lowprec_ran or self.blind:
            for name, op in stray:
                _say_stray(name, op)
        else:  # one message: the model was not converted
            read = f"; GEMMs read {_listed(name for name, _ in stray)} in high precision" if stray else ""
            say_once(
                f"lowprec.autocast: no lowprec layer ran inside it, so nothing ran in FP8{read}. Fix: convert the model "
                "first, model = lowprec.convert(model), or build it from lowprec layers",
                call_site=__name__,
            )

    def _names(self) -> dict[int, str]:
        """Each Parameter's name by id: as ``convert`` names the layers of the model holding it, else under the
        top-level module that ran, named ``model``."""
        names: dict[int, str] = {}
        holders = [(model, _converted[model].prefix) for model in self.ran]
        holders += [(root, DEFAULT_PREFIX) for root in self.roots.values()]
        for holder, prefix in holders:
            for name, parameter in holder.named_parameters():
                names.setdefault(id(parameter), f"{prefix}.{name}" if prefix else name)
        return names


class _ParameterReads(TorchDispatchMode):
    """Follows each Parameter through views and casts and tells the watch about the GEMMs reading it."""

    def __init__(self, watch: _Watch):
        super().__init__()
        self.watch = watch
        self.origins: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> the Parameter it views or casts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        factors = GEMMS.get(packet)
        if factors is not None:
            for i in factors:
                source = self._origin(args[i]) if i < len(args) else None
                if source is not None:
                    self.watch.read(source, str(packet))
        elif func.is_view or packet in COPIES:
            source = self._origin(args[0]) if args else None
            if source is not None:
                for leaf in tree_leaves(out):
                    if isinstance(leaf, torch.Tensor):
                        self.origins[leaf] = source
        return out

    def _origin(self, arg: Any) -> torch.nn.Parameter | None:
        if isinstance(arg, torch.nn.Parameter):
            return arg
        return self.origins.get(arg) if isinstance(arg, torch.Tensor) else None


def _say_skipped_ran(holder: str, type_name: str, reason: str, reads: list[str]) -> None:
    """Say once that the module ``convert`` skipped at ``holder`` ran GEMMs in high precision (unless the user's
    filter kept it: their choice)."""
    if reason != FILTERED_OUT:
        say_once(
            f"lowprec.autocast: {holder} ({type_name}) ran GEMMs in high precision although an FP8 recipe is in force "
            f"({', '.join(reads)}): lowprec.convert left it in high precision, {reason}. Fix: replace it by lowprec "
            "layers, or accept high precision for it",
            call_site=__name__,
        )


def _say_stray(name: str, op: str) -> None:
    """Say once that ``op`` read the Parameter ``name`` in high precision outside a lowprec layer."""
    say_once(
        f"lowprec.autocast: {op} read the Parameter {name} in high precision although an FP8 recipe is in force: no "
        "lowprec layer runs that GEMM (F.linear, matmul, @ or einsum on the Parameter, or a module lowprec.convert did "
        "not see). Fix: compute it with a lowprec layer (lowprec.Linear, or lowprec.convert the module holding it), or "
        "accept high precision for it",
        call_site=__name__,
    )


def _listed(names: Iterable[str], shown: int = 8) -> str:
    """The first ``shown`` of ``names``, and how many more."""
    names = list(names)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _record(layer: str, reason: str) -> None:
    """Routing records saying that every GEMM of ``layer`` reads its operands in high precision, and why."""
    manager = debug_api.DEBUG_MANAGER
    if manager is None:
        return
    for tensor in INPUT_TENSORS:
        for gemm in TENSOR_GEMMS[tensor]:
            debug_api.log_routing(
                layer=layer,
                gemm=gemm,
                tensor=tensor,
                decision="high_precision",
                feature=None,
                recipe=True,
                iteration=manager._trainer_iteration_count,
                reason=reason,
            )


set_entry_watch(watch_autocast)
