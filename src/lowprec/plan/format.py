"""lowprec's precision-plan format: a mapping, alone or under a ``precision_plan:`` key (also of a debug config).

```yaml
precision_plan:
  default: current                 # optional: layers no rule selects (absent: the lowprec.autocast's recipe)
  eval: high_precision             # optional: every layer's evaluation forward (absent: its training fprop's)
  rules:                           # in order; the first rule that selects a layer wins
    - name: head in high precision # optional, for messages
      layers: {layer_name_regex_pattern: 'lm_head$'}
      recipe: high_precision
    - layers: {layer_name_regex_pattern: 'attn'}
      recipe: {name: MXFP8BlockScaling, enable_2d_quantization: true}
    - layers: {layer_numbers: [3]}  # per GEMM; a GEMM not given takes the default
      fprop: mxfp8
      dgrad: nvfp4
      wgrad: current
      eval: high_precision         # optional: this rule's layers' evaluation forward
```

``layers`` is the debug config's selector (``nvdlfw_inspect.config_manager.LayerSpec``): ``exact_layer_names``,
``layer_name_regex_pattern``, ``layer_numbers``, ``layer_types``, ``layer_type_regex_pattern``; an expert GEMM of a
``GroupedLinear`` is the layer ``{name}.gemm_{i}``. A recipe is a spec of ``lowprec.plan.recipes``: a short name
(``mxfp8``), a class name (``MXFP8BlockScaling``), ``high_precision`` (``bf16``), or ``{name: ..., <option>: ...}``.
A rule gives ``recipe`` (every GEMM) or any of ``fprop``, ``dgrad``, ``wgrad``, not both.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from lowprec.plan.recipes import parse_recipe
from lowprec.plan.rules import AS_TRAINING, GEMMS, GemmRecipes, PrecisionPlan, Rule
from nvdlfw_inspect.config_manager import LayerSpec
from nvdlfw_inspect.errors import ConfigLocation, ErrorCollector

PLAN_KEYS = ("default", "eval", "rules")
RULE_KEYS = ("name", "layers", "recipe", *GEMMS, "eval")


def parse_plan(body: Any, location: ConfigLocation) -> PrecisionPlan:
    """Our format's plan body at ``location`` (every mistake found in one pass, as one ``ConfigError`` or a
    ``ConfigErrors``)."""
    if not isinstance(body, Mapping):
        raise location.error("a precision plan must be a mapping", body, PLAN_KEYS)
    collector = ErrorCollector()
    for key in body:
        if key not in PLAN_KEYS:
            collector.add(location.child(key).error("unknown precision plan key", key, PLAN_KEYS))
    default = GemmRecipes()
    with collector.check():
        if "default" in body:
            default = GemmRecipes.every(parse_recipe(body["default"], location.child("default")))
    eval_choice = AS_TRAINING
    with collector.check():
        if "eval" in body:
            eval_choice = parse_recipe(body["eval"], location.child("eval"))
    rules: list[Rule] = []
    raw_rules = body.get("rules", [])
    if not isinstance(raw_rules, list):
        collector.add(location.child("rules").error("must be a list of rules", raw_rules))
        raw_rules = []
    for index, raw in enumerate(raw_rules):
        with collector.check():
            rules.append(_parse_rule(raw, index, location.child("rules").child(index), default))
    collector.raise_errors()
    return PrecisionPlan(tuple(rules), default, eval_choice, location.source, "lowprec")


def _parse_rule(raw: Any, index: int, location: ConfigLocation, default: GemmRecipes) -> Rule:
    if not isinstance(raw, Mapping):
        raise location.error("a rule must be a mapping", raw, RULE_KEYS)
    collector = ErrorCollector()
    for key in raw:
        if key not in RULE_KEYS:
            collector.add(location.child(key).error("unknown rule key", key, RULE_KEYS))
    given = [g for g in GEMMS if g in raw]
    if "recipe" in raw and given:
        collector.add(
            location.error(
                f"give either 'recipe' (every GEMM) or per-GEMM keys ({', '.join(GEMMS)}), not both",
                {key: raw[key] for key in ("recipe", *given)},
            )
        )
    elif "recipe" not in raw and not given and "eval" not in raw:
        collector.add(location.error("a rule needs a recipe", dict(raw), ("recipe", *GEMMS, "eval")))
    name = raw.get("name", None)
    if name is not None and not (isinstance(name, str) and name):
        collector.add(location.child("name").error("must be a non-empty string", name))
        name = None
    selector = None
    if "layers" not in raw:
        collector.add(location.error("missing required key 'layers'", dict(raw), RULE_KEYS))
    else:
        with collector.check():
            selector = LayerSpec(raw["layers"], location.child("layers"))
    choices = {gemm: default.of(gemm) for gemm in GEMMS}
    with collector.check():
        if "recipe" in raw:
            choices = dict.fromkeys(GEMMS, parse_recipe(raw["recipe"], location.child("recipe")))
    for gemm in given:
        with collector.check():
            choices[gemm] = parse_recipe(raw[gemm], location.child(gemm))
    eval_choice = AS_TRAINING
    with collector.check():
        if "eval" in raw:
            eval_choice = parse_recipe(raw["eval"], location.child("eval"))
    collector.raise_errors()
    if selector.ignored_keys:
        warnings.warn(
            f"{location.source}: key '{location.key_path}.layers': {', '.join(selector.ignored_keys)} ignored, as a "
            "stronger selector is given (exact_layer_names, then layer_name_regex_pattern)",
            stacklevel=4,
        )
    description = name or f"rule {index}: layers {selector.raw!r}"
    return Rule(description, selector, GemmRecipes(**choices), eval_choice)
