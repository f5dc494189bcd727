"""Layer names for debugging: given with ``name=``, derived by composite layers, or ``Layer_{n}``."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from lowprec.errors import LowprecTypeError
from lowprec.modules.gemm_unit import GemmUnit
from lowprec.modules.grouped_gemm import GroupedGemm

_unnamed = itertools.count(1)


def default_name() -> str:
    """``Layer_1``, ``Layer_2``, ... for layers built without a name (numbers are never reused)."""
    return f"Layer_{next(_unnamed)}"


def gemm_leaves(model: torch.nn.Module) -> list[NamedModule]:
    """The named layers of ``model`` that call the debug API themselves: those holding no named layer."""
    return [
        module
        for module in model.modules()
        if isinstance(module, NamedModule) and not any(isinstance(child, NamedModule) for child in list(module.modules())[1:])
    ]


def gemm_sizes(model: torch.nn.Module) -> dict[str, int]:
    """Every GEMM layer of ``model`` (converted) and its weight elements, in model order."""
    return {name: size for leaf in gemm_leaves(model) for name, size in leaf.gemm_sizes().items()}


class NamedModule(torch.nn.Module):
    """A module with a debug ``name``; renaming a composite layer renames the layers inside it."""

    #: type names that config ``layer_types`` selectors match besides substrings of the name
    layer_types: tuple[str, ...] = ()

    def __init__(self, name: str | None):
        torch.nn.Module.__init__(self)  # not super(): torch.nn.Linear's __init__ (a base of lowprec.Linear) builds
        # parameters, and each layer builds its own
        if name is not None and not isinstance(name, str):
            raise LowprecTypeError(f"name must be a string, got {name!r}")
        self._name = default_name() if name is None else name

    @property
    def name(self) -> str:
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        if not isinstance(value, str):
            raise LowprecTypeError(f"name must be a string, got {value!r}")
        self._name = value
        self._name_children(value)

    def _name_children(self, name: str) -> None:
        """Composite layers derive their children's names from ``name``."""

    def debug_layers(self) -> list[tuple[str, tuple[str, ...]]]:
        """The names this module calls the debug API with and the types they declare, so that
        ``debug_api.infer_and_assign_layer_names`` can tell which config sections select none of them."""
        return [(self.name, self.layer_types)]

    def gemm_sizes(self) -> dict[str, int]:
        """Each of its GEMM layers' weight elements (``in x out``) by the name of ``debug_layers``: its GEMMs' share
        of the model's FLOPs (``lowprec.plan.cost``). A layer of one GEMM: its weight's."""
        return {self.name: self.weight.numel()}

    def set_tensor_parallel_group(self, group: Any) -> None:
        """The process group this layer's (and its sublayers') weights are sharded over: weight
        statistics are reduced over it. ``None``: weights are not sharded; their statistics stay per rank."""
        for module in self.modules():
            for value in vars(module).values():
                for unit in value.units if isinstance(value, GroupedGemm) else (value,):
                    if isinstance(unit, GemmUnit):
                        unit.tp_group = group

    def extra_repr(self) -> str:
        return f"name={self._name!r}"
