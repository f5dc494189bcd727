"""The remedies of a diagnosis as one config: a section per layer (``transformer_engine`` namespace),
each preceded by the sentences that explain it, ready for ``debug_api.initialize``.

Where remedies of one layer claim the same GEMM, the stronger wins: ``DisableFP8GEMM`` (high precision)
over ``FakeQuant`` (high precision, operands rounded to a format) over ``PerTensorScaling`` (FP8).
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable
from typing import Any

import yaml

from nvdlfw_inspect.diagnose.formats import GEMMS
from nvdlfw_inspect.diagnose.in_format import PLAN_FEATURE, PLAN_KEY, plan_rules
from nvdlfw_inspect.diagnose.model import Remedy
from nvdlfw_inspect.diagnose.remedies import WATCH_STATS, WATCH_TENSORS

NAMESPACE = "transformer_engine"
PRECEDENCE = ("DisableFP8GEMM", "FakeQuant", "PerTensorScaling")
WATCH_SECTION = "diagnose_watch_nonfinite"
HEADER = (
    "Remedies written by nvdlfw-inspect diagnose. Run: {source}\n"
    "Config namespace transformer_engine (lowprec and Transformer Engine layers): initialize with "
    "feature_dirs=[lowprec.FEATURE_DIR] (or import lowprec). A layer may get each feature from one section only: "
    "appending this file to a config that configures the same features for the same layers fails at the first "
    "forward. For one config made of yours and these remedies, run: nvdlfw-inspect diagnose LOG_DIR --config YOUR.yaml"
)
PLAN_NOTE = (
    "A precision plan for lowprec (the debug framework skips this key): each rule gives one layer's GEMMs the recipes "
    "written, the others as the run had them. The re-run needs it: lowprec.autocast(recipe=..., plan='<this file>'), "
    "or nvdlfw-inspect demo --plan <this file>. If your run had a plan in another file, put these rules first in it."
)
MERGED_HEADER = (
    "One config for the re-run, written by nvdlfw-inspect diagnose: your config {user} with the remedies of the run "
    "{source} merged in. It replaces your config for this re-run (do not append it to yours).\n"
    "Config namespace transformer_engine: initialize with feature_dirs=[lowprec.FEATURE_DIR] (or import lowprec). "
    "The comments above a section say what was changed in it and why."
)


def free_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base_2``, ``base_3``... the first not in ``taken`` (to which it is added)."""
    name, n = base, 2
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    taken.add(name)
    return name


def _section_name(layer: str, taken: set[str]) -> str:
    return free_name("diagnose_" + (re.sub(r"[^0-9A-Za-z_]+", "_", layer).strip("_") or "layer"), taken)


def gemm_tensor_selection(claims: dict[str, set[str]]) -> dict[str, Any]:
    """``gemms`` and ``tensors`` when every GEMM has the same tensors, else ``gemms_struct``."""
    gemms = [gemm for gemm in GEMMS if gemm in claims]
    tensors = {frozenset(claims[gemm]) for gemm in gemms}
    if len(tensors) == 1:
        return {"gemms": gemms, "tensors": sorted(claims[gemms[0]])}
    return {"gemms_struct": [{"gemm": gemm, "tensors": sorted(claims[gemm])} for gemm in gemms]}


def layer_features(remedies: Iterable[Remedy]) -> tuple[dict[str, Any], list[str]]:
    """The features of one layer's remedies, each GEMM given to the strongest remedy that claims it, and
    the reasons of the remedies that kept at least one GEMM."""
    remedies = list(remedies)
    winner: dict[str, str] = {}
    for remedy in remedies:
        for gemm in remedy.gemms:
            if gemm not in winner or PRECEDENCE.index(remedy.feature) < PRECEDENCE.index(winner[gemm]):
                winner[gemm] = remedy.feature
    claims: dict[str, dict[str, set[str]]] = {feature: {} for feature in PRECEDENCE}
    reasons: list[str] = []
    for remedy in remedies:
        kept = [gemm for gemm in remedy.gemms if winner[gemm] == remedy.feature]
        for gemm in kept:
            claims[remedy.feature].setdefault(gemm, set()).update([remedy.tensor] if remedy.tensor else [])
        if kept and remedy.reason not in reasons:
            reasons.append(remedy.reason)
    features: dict[str, Any] = {}
    if claims["DisableFP8GEMM"]:
        features["DisableFP8GEMM"] = {"enabled": True, "gemms": [g for g in GEMMS if g in claims["DisableFP8GEMM"]]}
    if claims["FakeQuant"]:
        quant_format = next(dict(r.options)["quant_format"] for r in remedies if r.feature == "FakeQuant")
        features["FakeQuant"] = {"enabled": True, "quant_format": quant_format, **gemm_tensor_selection(claims["FakeQuant"])}
    if claims["PerTensorScaling"]:
        features["PerTensorScaling"] = {"enabled": True, **gemm_tensor_selection(claims["PerTensorScaling"])}
    return features, reasons


def watch_section(remedy: Remedy) -> dict[str, Any]:
    """Statistics of every GEMM tensor of every layer at every iteration of the remedy's window."""
    stats = {"enabled": True, "tensors": WATCH_TENSORS, "stats": WATCH_STATS, **dict(remedy.options)}
    return {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, NAMESPACE: {"LogTensorStats": stats}}


def build(remedies: Iterable[Remedy]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """``(config, reasons by section)``: the watch section first, then one section per layer in the order
    the layers' first remedies come, then the remedies that change a layer's format, as the rules of a precision
    plan (``in_format``) under ``precision_plan:``."""
    config: dict[str, Any] = {}
    reasons: dict[str, list[str]] = {}
    by_layer: dict[str, list[Remedy]] = {}
    planned: list[Remedy] = []
    for remedy in remedies:
        if remedy.feature == PLAN_FEATURE:
            planned.append(remedy)
        elif remedy.layer is None:
            config[WATCH_SECTION] = watch_section(remedy)
            reasons[WATCH_SECTION] = [remedy.reason]
        else:
            by_layer.setdefault(remedy.layer, []).append(remedy)
    taken = {WATCH_SECTION}
    for layer, layer_remedies in by_layer.items():
        features, why = layer_features(layer_remedies)
        name = _section_name(layer, taken)
        config[name] = {"enabled": True, "layers": {"exact_layer_names": [layer]}, NAMESPACE: features}
        reasons[name] = [f"{layer}: {reason}" for reason in why]
    if planned:
        rules, why = plan_rules(planned)
        config[PLAN_KEY] = {"rules": rules}
        reasons[PLAN_KEY] = [PLAN_NOTE, *why]
    return config, reasons


def _comment(text: str) -> str:
    """``text`` as YAML comment lines; characters that could end a comment line become spaces."""
    text = "".join(c if c.isprintable() or c == "\n" else " " for c in text)
    lines = []
    for paragraph in text.split("\n"):
        lines += textwrap.wrap(paragraph, 110, break_on_hyphens=False) or [""]
    return "\n".join(f"# {line}".rstrip() for line in lines)


def to_yaml(config: dict[str, Any], reasons: dict[str, list[str]], source: str, header: str = "") -> str:
    """The config as YAML, the header (``HEADER`` of ``source`` unless given; then the reasons of section "") and
    each section's reasons as comments."""
    parts = [_comment("\n".join([header or HEADER.format(source=source), *reasons.get("", [])]))]
    for name, section in config.items():
        body = yaml.safe_dump({name: section}, sort_keys=False, default_flow_style=None, allow_unicode=True, width=1000)
        parts.append("\n".join(_comment(reason) for reason in reasons.get(name, [])) + "\n" + body.rstrip("\n"))
    return "\n\n".join(parts) + "\n"
