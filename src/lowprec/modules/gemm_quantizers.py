"""Which quantizer casts each operand of a layer's three GEMMs, when the GEMMs may run different recipes.

Each input tensor of a linear layer feeds two GEMMs (``TENSOR_GEMMS``): the activation fprop and wgrad, the weight
fprop and dgrad, the gradient dgrad and wgrad. Under one recipe both read one cast. Under a precision plan each GEMM
runs its own recipe (MXFP8 fprop, NVFP4 dgrad and wgrad, say), so a tensor is cast once per recipe that reads it.
Both operands of a GEMM come from that GEMM's recipe, so no GEMM multiplies two formats: a pair one recipe cannot
multiply (two 2-D block-scaled operands) is refused by the recipe itself when it is made.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from lowprec.debug.names import INPUT_TENSORS, TENSOR_GEMMS
from lowprec.debug.plan import GemmFormats
from lowprec.plan.rules import GEMMS, GemmRecipes
from lowprec.quant.protocol import CastState, Quantizer
from lowprec.recipe import Recipe

Pair = tuple[Quantizer | None, Quantizer | None]
"""The quantizers of a tensor's first and second GEMM (``TENSOR_GEMMS``); the same object when one recipe runs both."""


class GemmQuantizers:
    """Per input tensor, the quantizer of each GEMM that reads it (None: that GEMM reads it in high precision)."""

    def __init__(self, recipes: GemmRecipes, pairs: dict[str, Pair], rule: str | None = None):
        self.recipes = recipes
        self.pairs = pairs
        self.rule = rule
        labels = {
            (tensor, gemm): None if quantizer is None else quantizer.label
            for tensor, pair in pairs.items()
            for gemm, quantizer in zip(TENSOR_GEMMS[tensor], pair, strict=True)
        }
        self.formats = GemmFormats.of(labels, {gemm: recipes.of(gemm) for gemm in GEMMS}, rule)

    @classmethod
    def of(
        cls, recipes: GemmRecipes, quantizers_of: Callable[[Recipe], dict[str, Quantizer]], rule: str | None = None
    ) -> GemmQuantizers:
        """The quantizers of ``recipes`` (each GEMM's recipe, None: high precision), each recipe's from
        ``quantizers_of`` (a layer's, which keeps their state); ``rule``: the precision plan rule that chose them."""
        made = {recipe: quantizers_of(recipe) for recipe in {recipes.of(g) for g in GEMMS} if recipe is not None}

        def quantizer(tensor: str, gemm: str) -> Quantizer | None:
            recipe = recipes.of(gemm)
            return None if recipe is None else made[recipe][tensor]

        pairs = {
            tensor: (quantizer(tensor, TENSOR_GEMMS[tensor][0]), quantizer(tensor, TENSOR_GEMMS[tensor][1]))
            for tensor in INPUT_TENSORS
        }
        return cls(recipes, pairs, rule)

    def pair(self, tensor_name: str) -> Pair:
        return self.pairs[tensor_name]

    def shared(self, tensor_name: str) -> bool:
        """Whether one cast serves both GEMMs of the tensor (one recipe runs both, or neither quantizes)."""
        first, second = self.pairs[tensor_name]
        return first is second

    def reported(self, tensor_name: str) -> Quantizer | None:
        """The quantizer whose cast the inspection features describe: the first GEMM's, else the second's."""
        first, second = self.pairs[tensor_name]
        return first if first is not None else second

    @property
    def quantizes(self) -> bool:
        return self.formats.any

    def replaying(self, states: dict[str, tuple[CastState, CastState]], names: Collection[str] | None = None) -> GemmQuantizers:
        """Quantizers that repeat a forward's casts (``cast_states``): each with the scale (or the noise) its original
        cast used, recording nothing; ``names``: the tensors to repeat (None: all), the others keep the live ones."""
        pairs: dict[str, Pair] = {}
        for tensor, (first, second) in self.pairs.items():
            if names is not None and tensor not in names:
                pairs[tensor] = (first, second)
                continue
            first_state, second_state = states.get(tensor, (None, None))
            if first is second:
                replay = None if first is None else first.replaying(first_state if first_state is not None else second_state)
                pairs[tensor] = (replay, replay)
            else:
                pairs[tensor] = (
                    None if first is None else first.replaying(first_state),
                    None if second is None else second.replaying(second_state),
                )
        return GemmQuantizers(self.recipes, pairs, self.rule)


HIGH_PRECISION = GemmQuantizers(GemmRecipes.every(None), {tensor: (None, None) for tensor in INPUT_TENSORS})
