"""Precision plans: which recipe each layer, and each of its GEMMs, runs; read from lowprec's format or
Megatron-LM's precision file (``--te-precision-config-file``).

- ``rules``: the plan, its rules and ``PrecisionPlan.resolve(layer_name) -> LayerPrecision``;
- ``recipes``: recipe specs by name and options -> ``lowprec.Recipe``;
- ``format``: lowprec's format (documented there); ``megatron``: Megatron's file; ``load``: ``load_plan``.
"""

from lowprec.plan.load import load_plan
from lowprec.plan.recipes import named_recipe, parse_recipe
from lowprec.plan.rules import (
    AS_TRAINING,
    FROM_AUTOCAST,
    GEMMS,
    GemmRecipes,
    LayerPrecision,
    Override,
    PrecisionPlan,
    Rule,
    UnusedPlanRuleWarning,
    UnusedRule,
)

__all__ = [
    "AS_TRAINING",
    "FROM_AUTOCAST",
    "GEMMS",
    "GemmRecipes",
    "LayerPrecision",
    "Override",
    "PrecisionPlan",
    "Rule",
    "UnusedPlanRuleWarning",
    "UnusedRule",
    "load_plan",
    "named_recipe",
    "parse_recipe",
]
