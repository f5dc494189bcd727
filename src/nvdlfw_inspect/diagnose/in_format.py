"""Remedies that keep a block format: what the format's designers found repairs its losses, written as a rule of a
precision plan (``lowprec``'s format, under the ``precision_plan:`` key of the config ``diagnose`` writes), one rung
of a ladder at a time; high precision only when no rung is left, and its reason says that it leaves the format.

The rungs, for the GEMMs that read the tensor (each GEMM from the recipe its routing records name, options and all):

- NVFP4 (arXiv 2509.25149, NVIDIA's NVFP4 training recipe): stochastic rounding of the gradient where it was
  turned off (a value under half E2M1's smallest step is kept on average instead of always flushed); the random
  Hadamard transform of wgrad's operands where it was turned off and the finding is about that cast (``_columnwise``
  statistics; it spreads a block's outlier over the block, so its neighbours keep their bits); then MXFP8 (8-bit
  elements). 2-D (16 x 16) weight scaling is not a rung: it makes fprop and dgrad read the same weight, and a scale
  per 256 values loses more to zero than one per 16, so no loss measured here calls for it.
- MX formats under the OCP rule (E8M0 scale rounded down): values that saturate are repaired by rounding the scale
  up (arXiv 2506.08027, the MXFP8 pre-training study: floor scales clipped block maxima and diverged); what flushes
  to zero, by a wider element: MXFP4 -> MXFP6 E3M2 -> MXFP8 E4M3 -> E5M2 (more exponent bits: more range per block).
- MXFP8 (Transformer Engine's): E5M2 elements (HYBRID for a gradient), then high precision.
- FP8 block scaling: 1-D blocks where a weight had 128 x 128, then MXFP8's blocks of 32.
"""

from __future__ import annotations

from typing import Any

from nvdlfw_inspect.diagnose.formats import GEMMS, TENSOR_GEMMS, format_name
from nvdlfw_inspect.diagnose.model import Finding, Remedy

PLAN_KEY = "precision_plan"
PLAN_FEATURE = "precision_plan"  # a Remedy's ``feature`` when it is a plan rule rather than a config feature
RULE_PREFIX = "diagnose: "
"""The name of every rule ``diagnose`` writes starts so: ``diagnose: <layer>: <tensor>[, <tensor>]``; the re-run's
routing records carry it (``plan_rule``), which tells ``in_place`` what it was written for."""
MX_ELEMENTS_WIDER = {"e2m1": "e3m2", "e2m3": "e4m3", "e3m2": "e4m3", "e4m3": "e5m2"}
#: the bits of each MX element, how a wider one is told (``width``)
ELEMENT_BITS = {"e2m1": 4, "e2m3": 6, "e3m2": 6, "e4m3": 8, "e5m2": 8}
MX_NAMES = {"e2m1": "MXFP4", "e2m3": "MXFP6 E2M3", "e3m2": "MXFP6 E3M2", "e4m3": "MXFP8", "e5m2": "MXFP8 E5M2"}
OCP_DEFAULT = ("e3m2", "e2m3", "e2m1")  # the MX elements whose default scale rule is the OCP one (the floor)


def rule_name(layer: str, tensors: list[str]) -> str:
    return f"{RULE_PREFIX}{layer}: {', '.join(tensors)}"


def rule_tensors(name: str | None) -> tuple[str, list[str]] | None:
    """``(layer, tensors)`` of a rule ``diagnose`` wrote (``rule_name``), None for any other rule."""
    if not name or not name.startswith(RULE_PREFIX):
        return None
    layer, _, tensors = name[len(RULE_PREFIX) :].rpartition(": ")
    return (layer, tensors.split(", ")) if layer else None


def _mx_rule(spec: dict[str, Any], element: str) -> str:
    rule = spec.get("scale_rule", None)
    return rule or ("ocp" if element in OCP_DEFAULT else "nvidia")


Step = tuple[dict[str, Any], int, str, str]


def _step(spec: dict[str, Any], tensor: str, kind: str, columnwise: bool) -> Step | None:
    """The next rung for ``tensor`` read under ``spec`` (a plan's recipe spec): ``(new spec, width, why, format)``,
    where ``width`` orders rungs that meet on one GEMM (the wider wins) and ``format`` names the format it reads the
    tensor in, in words; None when no rung keeps a low-precision format."""
    name = spec["name"]
    if name == "NVFP4BlockScaling":
        if kind != "block_saturation" and tensor == "gradient" and spec.get("disable_stochastic_rounding", False):
            why = (
                "stochastic rounding of the gradient, off in this run, rounds each value up or down with the odds that "
                "keep its mean, so values under half of E2M1's smallest step are kept on average instead of all flushed "
                "(NVIDIA's NVFP4 recipe, arXiv 2509.25149, rounds gradients so)"
            )
            return {**spec, "disable_stochastic_rounding": False}, 4, why, "NVFP4"
        if columnwise and tensor in ("activation", "gradient") and spec.get("disable_rht", False):
            why = (
                "the random Hadamard transform of wgrad's operands, off in this run, spreads a block's outlier over its 16 "
                "values so that the others keep their bits (NVIDIA's NVFP4 recipe, arXiv 2509.25149, applies it to wgrad)"
            )
            return {**spec, "disable_rht": False}, 4, why, "NVFP4"
        return {"name": "MXFP8BlockScaling"}, 8, "MXFP8 (E4M3 elements, 4 more bits than E2M1, a scale per 32 values)", "MXFP8"
    if name == "MXFP8BlockScaling":
        fmt = spec.get("fp8_format", "E4M3")
        if kind == "block_saturation" or fmt == "E5M2" or (fmt == "HYBRID" and tensor == "gradient"):
            return None  # its scales round up (nothing saturates but infinities), and E5M2 is the widest element
        wider = "HYBRID" if tensor == "gradient" and fmt == "E4M3" else "E5M2"
        whose = "the gradient" if wider == "HYBRID" else "its operands"
        why = f"MXFP8 with E5M2 elements for {whose} (fp8_format {wider}): 15 more bits of range per block of 32 than E4M3"
        return {**spec, "fp8_format": wider}, 9, why, "MXFP8"
    if name == "MXBlockScaling":
        key = "gradient_element" if tensor == "gradient" and "gradient_element" in spec else "element"
        element = spec.get(key, "e4m3")
        if kind == "block_saturation":
            if _mx_rule(spec, element) != "ocp":
                return None
            why = (
                "E8M0 scales rounded up (Transformer Engine's rule) instead of the OCP rule's floor, under which a block's "
                "largest values saturate (the MXFP8 pre-training study, arXiv 2506.08027, saw floor scales diverge)"
            )
            return {**spec, "scale_rule": "nvidia"}, ELEMENT_BITS[element], why, MX_NAMES[element]
        wider = MX_ELEMENTS_WIDER.get(element)
        if wider is None:
            return None
        what = "more exponent range" if wider in ("e3m2", "e5m2") else "MXFP8"
        why = f"MX {wider.upper()} elements ({ELEMENT_BITS[wider]} bits, {what}) in the same blocks of 32"
        return {**spec, key: wider}, ELEMENT_BITS[wider] + (wider == "e5m2"), why, MX_NAMES[wider]
    if name == "Float8BlockScaling":
        if tensor == "weight" and spec.get("w_block_scaling_dim", 2) == 2:
            why = "1 x 128 blocks of the weight instead of 128 x 128: a scale per 128 values, not per 16384"
            return {**spec, "w_block_scaling_dim": 1}, 8, why, "FP8 block scaling"
        return {"name": "MXFP8BlockScaling"}, 8, "MXFP8's blocks of 32 values (a scale each) instead of 128", "MXFP8"
    return None


def plan_remedy(finding: Finding, lost: str) -> Remedy | None:
    """The next rung for ``finding`` (``lost``: what the format loses, in words) on the GEMMs that read its tensor in
    the format its statistics measured, as a plan remedy, where the routing records named each GEMM's recipe; None
    where no rung is left or the recipes are not known (runs of other frameworks), and high precision is the remedy."""
    recipes = finding.context.get("recipes") or {}
    measured = finding.format.label if finding.format is not None else None
    gemms = tuple(gemm for gemm, label in finding.format.gemms if label == measured) if finding.format is not None else ()
    if not gemms or any(recipes.get(gemm) is None for gemm in gemms):
        return None
    columnwise = finding.stat.endswith("_columnwise")
    steps = {gemm: _step(recipes[gemm], finding.tensor, finding.kind, columnwise) for gemm in gemms}
    if any(step is None for step in steps.values()):
        return None
    new = {}
    changes: dict[str, list[str]] = {}
    fmt = format_name(measured)
    for gemm, (spec, _, why, name) in steps.items():  # type: ignore[misc]
        new[gemm] = spec
        keeps = name.upper() == fmt.upper()
        changes.setdefault(f"{why} ({f'stays in {fmt}' if keeps else f'{fmt} -> {name}'})", []).append(gemm)
    said = "; ".join(f"{' and '.join(on)}: {change}" for change, on in changes.items())
    reason = (
        f"{lost} in {fmt}; a rule of the precision plan changes the GEMMs that read it in {fmt}, {said}; its other "
        f"GEMMs keep their recipes (the re-run needs the plan: lowprec.autocast(plan=<this config>), or demo --plan "
        f"<this config>)."
    )
    width = max(step[1] for step in steps.values())  # type: ignore[index]
    options = (("recipes", {gemm: new[gemm] for gemm in gemms}), ("base", dict(recipes)), ("width", width))
    return Remedy(PLAN_FEATURE, finding.layer, gemms, finding.tensor, reason, options)


def high_precision(finding: Finding, lost: str) -> Remedy:
    """The last rung: the GEMMs that read the tensor in high precision, said to abandon the format."""
    gemms = TENSOR_GEMMS.get(finding.tensor, ())
    fmt = "its format" if finding.format is None else finding.format.measured
    why = (
        f"{lost} in {fmt}, and no wider low-precision format is left to try (or the run's records do not name its recipe), "
        f"so the GEMMs that read it ({' and '.join(gemms)}) run in high precision: this abandons the format for them."
    )
    return Remedy("DisableFP8GEMM", finding.layer, gemms, None, why)


def plan_rules(remedies: list[Remedy]) -> tuple[list[dict[str, Any]], list[str]]:
    """One plan rule per layer from its plan remedies, each GEMM from the widest remedy that changes it (remedies of
    one recipe class and width combined: their options merged); and the reasons, one per remedy kept."""
    by_layer: dict[str, list[Remedy]] = {}
    for remedy in remedies:
        assert remedy.layer is not None  # a plan remedy is of one layer
        by_layer.setdefault(remedy.layer, []).append(remedy)
    rules, reasons = [], []
    for layer, layer_remedies in by_layer.items():
        chosen: dict[str, tuple[int, dict[str, Any]]] = {}
        base = {gemm: spec or {} for gemm, spec in dict(layer_remedies[0].options)["base"].items()}
        tensors: list[str] = []
        for remedy in layer_remedies:
            options = dict(remedy.options)
            for gemm in remedy.gemms:
                spec, width = options["recipes"][gemm], options["width"]
                kept = chosen.get(gemm)
                if kept is None or width > kept[0]:
                    chosen[gemm] = (width, spec)
                elif width == kept[0] and spec["name"] == kept[1]["name"]:
                    chosen[gemm] = (width, {**kept[1], **{k: v for k, v in spec.items() if v != base[gemm].get(k)}})
            if remedy.tensor and remedy.tensor not in tensors:
                tensors.append(remedy.tensor)
            reasons.append(f"{layer}: {remedy.reason}")
        rule: dict[str, Any] = {"name": rule_name(layer, tensors), "layers": {"exact_layer_names": [layer]}}
        for gemm in GEMMS:
            rule[gemm] = chosen[gemm][1] if gemm in chosen else base.get(gemm) or "high_precision"
        rules.append(rule)
    return rules, reasons
