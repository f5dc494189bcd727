r"""One config for a re-run: the user's config with the remedies of a diagnosis merged in.

A layer may get each feature from one section only, so appending the remedies (``diagnose/config.py``) to a
config that configures the same ``transformer_engine`` features for the same layers fails at the first forward.
``merge`` makes one config of both; every change to a user section is a note, written above it as a comment.

- A remedy section (one layer L, by exact name) that shares a feature with a user section S selecting L (or
  where both choose GEMM precisions: ``DisableFP8GEMM``, ``FakeQuant``, ``PerTensorScaling``): L is taken out
  of S, and L's section gets S's features too, each feature both configure combined: ``DisableFP8GEMM`` (and
  its other names) the union of the GEMMs; ``PerTensorScaling`` and ``FakeQuant`` the union of the (GEMM,
  tensor) pairs, the remedy's options winning where both set a pair (a note says so); every other feature of
  S (statistics) copied unchanged. Then, as among the remedies, a GEMM in high precision is taken from
  ``FakeQuant`` and ``PerTensorScaling``, and one of ``FakeQuant`` from ``PerTensorScaling`` (said in a note).
- L leaves S as follows. Exact names: L is dropped (S is disabled when no name is left). A name regex P:
  ``\A(?!(?-i:L)\Z)(?s:.*?)(?:P)``, which ``re.search`` finds in exactly the names P is found in, but L (anchored
  at the start, ``.*?`` lets P start anywhere, as a search does; L is compared case-sensitively; a leading global
  flag group of P is moved in front). ``layer_numbers``/``layer_types``: no selector excludes a layer from
  those, and ``layer_types`` also match the types layers declare (lowprec's ``Linear`` declares ``linear``),
  which the logs do not hold; so S becomes the exact names of the run's layers it selects by name, minus L (a
  note says so). Such a section is rewritten whenever it shares a feature with a remedy or the watch, since it
  may select any layer by type.
- The watch section (``transformer_engine.LogTensorStats`` of every layer in a window, ``freq: 1``): its tensors
  and stats are added to each user ``LogTensorStats`` of that namespace, whose schedule becomes the window (the
  user's own statistics are logged in that window only, for this re-run); the run's layers that no section's
  ``LogTensorStats`` selects keep the watch, by their exact names.
- The remedies' precision plan rules (``precision_plan:``, ``in_format``): first in the user's plan (of lowprec's
  format), replacing the rules ``diagnose`` wrote before for the same layers; or the whole plan.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from nvdlfw_inspect.config_manager import OTHER_TOOLS_KEYS, LayerSpec
from nvdlfw_inspect.diagnose.config import NAMESPACE, WATCH_SECTION, free_name, gemm_tensor_selection
from nvdlfw_inspect.diagnose.formats import GEMMS
from nvdlfw_inspect.diagnose.in_format import PLAN_KEY, rule_tensors
from nvdlfw_inspect.errors import ConfigLocation

DISABLE_GEMM = ("DisableFP8GEMM", "DisableQuantizationGEMM", "DisableFp8Gemm")
PAIR_FEATURES = ("PerTensorScaling", "FakeQuant")
PRECISION = {*DISABLE_GEMM, *PAIR_FEATURES}  # features that choose a GEMM's precision: one section decides them
WINDOW_KEYS = ("start_step", "end_step", "freq", "start_end_list")
_SELECTION_KEYS = ("enabled", "gemm", "gemms", "gemms_struct", "tensor", "tensors", "tensors_struct")
PLAN_KEYS = {"default", "eval", "rules"}  # lowprec's plan format (the remedies' rules go first in it)
_GLOBAL_FLAGS = re.compile(r"\A\(\?([aiLmsux]+)\)")

Notes = dict[str, list[str]]


def merge(
    user_config: dict[str, Any], remedies_config: dict[str, Any], layers: list[str], reasons: Notes | None = None
) -> tuple[dict[str, Any], Notes]:
    """``(config, notes by section)``: ``user_config``'s sections, changed as the module says, then the remedy
    sections of ``remedies_config`` (``diagnose``'s), then what is left of its watch section. ``layers``: the
    names of the run's layers (``Diagnosis.layers``, ``reading.run_layers``); ``reasons``: the remedy sections'
    reasons, which start their notes (under the names the sections get here; notes of "" are about the whole
    config)."""
    merged = copy.deepcopy(user_config)
    remedies = copy.deepcopy(remedies_config)
    reasons = reasons or {}
    notes: Notes = {}
    watch = remedies.pop(WATCH_SECTION, None)
    plan = remedies.pop(PLAN_KEY, None)
    user = {name: _spec(name, section) for name, section in merged.items() if _enabled(section) and name not in OTHER_TOOLS_KEYS}
    remedy_layers = {name: section["layers"]["exact_layer_names"][0] for name, section in remedies.items()}
    window = watch[NAMESPACE]["LogTensorStats"] if watch else None
    for name, spec in user.items():
        features = _features(merged[name])
        if _by_number_or_type(spec) and (
            (window is not None and "LogTensorStats" in features)
            or any(_shared(merged[name], remedies[r]) for r in remedy_layers)
        ):
            _to_exact_names(merged, name, spec, layers, notes)
            user[name] = _spec(name, merged[name])
    if window is not None:
        for name in user:
            if _enabled(merged[name]) and "LogTensorStats" in _features(merged[name]):
                _watch_into(merged[name][NAMESPACE], window, notes.setdefault(name, []))
    taken = set(merged)
    for remedy_name, layer in remedy_layers.items():
        name = free_name(remedy_name, taken)
        notes[name] = list(reasons.get(remedy_name, []))
        if name != remedy_name:
            notes.setdefault(name, []).append(f"Named {name}: your config has a section {remedy_name}.")
        _take_layer_out(merged, user, remedies[remedy_name], layer, notes.setdefault(name, []), notes)
        merged[name] = remedies[remedy_name]
    for name, spec in user.items():
        rewritten = _enabled(merged[name]) and merged[name]["layers"] != user_config[name]["layers"]
        if rewritten and spec.name_regex is not None and not any(spec.matches(layer) for layer in layers):
            notes[name].append("It now selects none of the run's layers (the re-run warns of it unless it selects others).")
    if watch is not None:
        _rest_of_watch(merged, watch, layers, taken, reasons, notes)
    if plan is not None:
        _plan_into(merged, plan, reasons.get(PLAN_KEY, []), notes)
    return merged, {name: lines for name, lines in notes.items() if lines}


def _plan_into(merged: dict, plan: dict, reasons: list[str], notes: Notes) -> None:
    """The remedies' plan rules put first in the user's ``precision_plan`` (a rule ``diagnose`` wrote earlier for one
    of their layers is replaced: the run read its recipes, which the new rule starts from), or as the whole plan."""
    notes[PLAN_KEY] = list(reasons)
    user_plan = merged.get(PLAN_KEY)
    if user_plan is None:
        merged[PLAN_KEY] = plan
        return
    user_rules = user_plan.get("rules", []) if isinstance(user_plan, dict) and set(user_plan) <= PLAN_KEYS else None
    if not isinstance(user_rules, list):
        raise ValueError(
            f"your config's {PLAN_KEY} is not lowprec's plan format (keys {sorted(PLAN_KEYS)}, e.g. Megatron-LM's precision "
            f"file), so the remedies' rules cannot be put first in it; write them there yourself: {plan['rules']}"
        )
    layers = {rule["layers"]["exact_layer_names"][0] for rule in plan["rules"]}
    kept = []
    for rule in user_rules:
        earlier = rule_tensors(rule.get("name")) if isinstance(rule, dict) else None
        if earlier is not None and earlier[0] in layers:
            notes[PLAN_KEY].append(
                f"Replaces your rule {rule['name']!r}: this run read its recipes, the new rule starts from them."
            )
        else:
            kept.append(rule)
    merged[PLAN_KEY] = {**user_plan, "rules": [*plan["rules"], *kept]}
    notes[PLAN_KEY].append(
        f"Its rules come first in your {PLAN_KEY}, before your {len(kept)} rules (the first rule that selects a layer wins)."
    )


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and section.get("enabled") is not False


def _spec(name: str, section: dict) -> LayerSpec:
    return LayerSpec(section.get("layers"), ConfigLocation("the user config").child(name).child("layers"))


def _features(section: dict) -> dict[str, Any]:
    """The section's features of the remedies' namespace (other keys can share no feature with a remedy)."""
    features = section.get(NAMESPACE)
    return features if isinstance(features, dict) else {}


def _shared(section: dict, remedy: dict) -> set[str]:
    """The features that keep a layer from being selected by both: those both configure, and when both choose
    GEMM precisions, every one of those (see ``_stronger_wins``)."""
    mine, theirs = set(_features(section)), set(_features(remedy))
    return (mine & theirs) | ((mine | theirs) & PRECISION if mine & PRECISION and theirs & PRECISION else set())


def _by_number_or_type(spec: LayerSpec) -> bool:
    return spec.exact_layer_names is None and spec.name_regex is None


def _to_exact_names(merged: dict, name: str, spec: LayerSpec, layers: list[str], notes: Notes) -> None:
    """Rewrite a ``layer_numbers``/``layer_types`` section to the run's layers it selects by name."""
    selected = [layer for layer in layers if spec.matches(layer)]
    before = merged[name]["layers"]
    notes.setdefault(name, []).append(
        f"Its layers were {before}: rewritten to the {len(selected)} layers of the run it selects by name, since the "
        "remedies configure its features on some of them and no other selector can leave a layer out. A layer it "
        "selected only by a type the layer declares (e.g. lowprec's 'linear') is no longer selected: add its name."
    )
    if selected:
        merged[name]["layers"] = {"exact_layer_names": selected}
    else:
        merged[name]["enabled"] = False
        notes[name].append("Disabled: it selects none of the run's layers by name.")


def _take_layer_out(
    merged: dict, user: dict[str, LayerSpec], remedy: dict, layer: str, remedy_notes: list[str], notes: Notes
) -> None:
    """Each enabled user section that selects ``layer`` and shares a feature with its remedy section gives the
    layer up, and its features for the layer to the remedy section (combined where both have one)."""
    for name, spec in user.items():
        section = merged[name]
        if section.get("enabled") is False or not spec.matches(layer):
            continue
        shared = _shared(section, remedy)
        if not shared:
            continue
        for key, value in section.items():
            if key in ("enabled", "layers"):
                continue
            if key != NAMESPACE:
                remedy[key] = copy.deepcopy(value)
                continue
            for feature, cfg in value.items():
                theirs = remedy[NAMESPACE].get(feature)
                combined = copy.deepcopy(cfg) if theirs is None else _combined(feature, cfg, theirs, name, layer, notes)
                remedy[NAMESPACE][feature] = combined
        _exclude(merged, name, spec, layer, sorted(shared), notes)
        _stronger_wins(remedy[NAMESPACE], remedy_notes)
        remedy_notes.append(
            f"It has the features of your section {name} for {layer} too, {sorted(shared)} combined with the remedies."
        )
        user[name] = _spec(name, merged[name])


def _exclude(merged: dict, name: str, spec: LayerSpec, layer: str, shared: list[str], notes: Notes) -> None:
    section, why = merged[name], f"{layer} left it for its own section, which has its features and the remedies ({shared})"
    if spec.exact_layer_names is not None:
        names = [n for n in section["layers"]["exact_layer_names"] if n != layer]
        if names:
            section["layers"] = {"exact_layer_names": names}
            notes.setdefault(name, []).append(f"{why}.")
        else:
            section["enabled"] = False
            notes.setdefault(name, []).append(f"Disabled: {why}, and it selected no other layer.")
        return
    before = section["layers"]["layer_name_regex_pattern"]
    flags = _GLOBAL_FLAGS.match(before)
    pattern = before[flags.end() :] if flags else before
    after = f"{flags.group(0) if flags else ''}\\A(?!(?-i:{re.escape(layer)})\\Z)(?s:.*?)(?:{pattern})"
    section["layers"] = {"layer_name_regex_pattern": after}
    notes.setdefault(name, []).append(f"{why}: its regex {before!r} now leaves that name out and selects the others as before.")


def _combined(feature: str, user: dict, remedy: dict, section: str, layer: str, notes: Notes) -> dict:
    """One config of ``feature`` for ``layer`` from the user section's and the remedy's."""
    if user.get("enabled") is False:
        notes.setdefault(section, []).append(f"{layer}: your {feature} there is disabled; the remedy's applies.")
        return remedy
    if feature in DISABLE_GEMM:
        gemms = set(_gemms(user)) | set(_gemms(remedy))
        return {"enabled": True, "gemms": [gemm for gemm in GEMMS if gemm in gemms]}
    if feature in PAIR_FEATURES:
        pairs = _pairs(user)
        for pair, options in _pairs(remedy).items():
            if pair in pairs and pairs[pair] != options:
                notes.setdefault(section, []).append(
                    f"{layer}: {feature} on {pair[0]} {pair[1]}: the remedy's options {options} replace yours {pairs[pair]}."
                )
            pairs[pair] = options
        return _from_pairs(pairs)
    return remedy  # the remedies configure no other feature


def _stronger_wins(features: dict, notes: list[str]) -> None:
    """A GEMM in high precision (``DisableFP8GEMM`` and its other names) is taken from ``FakeQuant`` and
    ``PerTensorScaling``, and one of ``FakeQuant`` from ``PerTensorScaling``: the precedence of the remedies
    (``diagnose/config.py``), kept when yours and the remedies' meet on one layer."""
    taken = {gemm for feature in DISABLE_GEMM if _on(features, feature) for gemm in _gemms(features[feature])}
    for feature in PAIR_FEATURES[::-1]:  # FakeQuant first: it takes its GEMMs from PerTensorScaling
        if not _on(features, feature):
            continue
        pairs = _pairs(features[feature])
        kept = {pair: options for pair, options in pairs.items() if pair[0] not in taken}
        if len(kept) < len(pairs):
            lost = sorted({gemm for gemm, _ in pairs} & taken)
            notes.append(f"{feature} leaves {lost}: a stronger feature (high precision, or FakeQuant) has it.")
            if kept:
                features[feature] = _from_pairs(kept)
            else:
                del features[feature]
        taken |= {gemm for gemm, _ in kept}


def _on(features: dict, feature: str) -> bool:
    return feature in features and features[feature].get("enabled") is not False


def _gemms(cfg: dict) -> list[str]:
    if "gemms_struct" in cfg:
        return [item["gemm"] for item in cfg["gemms_struct"]]
    return list(cfg.get("gemms", []))


def _pairs(cfg: dict) -> dict[tuple[str, str], dict]:
    """Each (GEMM, tensor) the config selects -> its options, as the ``transformer_engine`` grammar resolves them:
    a ``gemms_struct`` item overrides the feature's options (its tensors replace the feature's), a
    ``tensors_struct`` item overrides those."""
    if "gemms_struct" in cfg:
        shared = {k: v for k, v in cfg.items() if k not in ("gemms_struct", "gemms", "enabled")}
        views = []
        for item in cfg["gemms_struct"]:
            own = any(key in item for key in ("tensors", "tensors_struct"))
            base = {k: v for k, v in shared.items() if not (own and k in ("tensors", "tensors_struct"))}
            views.append({**base, **item})
    else:
        views = [{**cfg, "gemm": gemm} for gemm in cfg.get("gemms", [])]
    pairs = {}
    for view in views:
        if "tensors_struct" in view:
            tensor_views = [{**view, **item} for item in view["tensors_struct"]]
        else:
            names = view.get("tensors", [])
            tensor_views = [{**view, "tensor": t} for t in ([names] if isinstance(names, str) else names)]
        for tv in tensor_views:
            pairs[(tv["gemm"], tv["tensor"])] = {k: v for k, v in tv.items() if k not in _SELECTION_KEYS}
    return pairs


def _from_pairs(pairs: dict[tuple[str, str], dict]) -> dict:
    """A feature config selecting ``pairs`` with their options: shared options at the feature's level, else one
    ``tensors_struct`` item per pair."""
    options = list(pairs.values())
    claims: dict[str, set[str]] = {}
    for gemm, tensor in pairs:
        claims.setdefault(gemm, set()).add(tensor)
    if all(o == options[0] for o in options):
        return {"enabled": True, **options[0], **gemm_tensor_selection(claims)}
    items = [
        {"gemm": gemm, "tensors_struct": [{"tensor": t, **pairs[(gemm, t)]} for t in sorted(claims[gemm])]}
        for gemm in GEMMS
        if gemm in claims
    ]
    return {"enabled": True, "gemms_struct": items}


def _watch_into(features: dict, window: dict, notes: list[str]) -> None:
    """Add the watch's tensors and stats to the section's ``LogTensorStats`` and give it the watch's schedule."""
    mine = features["LogTensorStats"]
    schedule = {k: window[k] for k in WINDOW_KEYS if k in window}
    if mine.get("enabled") is False:
        features["LogTensorStats"] = copy.deepcopy(window)
        notes.append("Its LogTensorStats was disabled: it logs the watch's statistics now (see the watch's reason).")
        return
    stats: dict[str, list] = {}
    if "tensors_struct" in mine:
        for item in mine["tensors_struct"]:
            stats[item["tensor"]] = list(item.get("stats", mine.get("stats", [])))
    else:
        names = mine.get("tensors", [])
        for tensor in [names] if isinstance(names, str) else names:
            stats[tensor] = list(mine.get("stats", []))
    for tensor in window["tensors"]:
        kept = stats.setdefault(tensor, [])
        kept += [stat for stat in window["stats"] if stat not in kept]
    rest = {k: v for k, v in mine.items() if k not in (*WINDOW_KEYS, "enabled", "tensors", "tensors_struct", "stats")}
    if all(s == next(iter(stats.values())) for s in stats.values()):
        selection = {"tensors": list(stats), "stats": next(iter(stats.values()))}
    else:
        selection = {"tensors_struct": [{"tensor": t, "stats": s} for t, s in stats.items()]}
    features["LogTensorStats"] = {"enabled": True, **rest, **selection, **schedule}
    notes.append(
        f"Its LogTensorStats also logs the watch's {window['stats']} of {window['tensors']}, on the watch's schedule "
        f"{schedule}: for this re-run your own statistics there are logged in that window only."
    )


def _rest_of_watch(merged: dict, watch: dict, layers: list[str], taken: set[str], reasons: Notes, notes: Notes) -> None:
    """The watch for the run's layers that no enabled section's ``LogTensorStats`` selects, by exact name."""
    covering = [
        _spec(name, section) for name, section in merged.items() if _enabled(section) and "LogTensorStats" in _features(section)
    ]
    rest = [layer for layer in layers if not any(spec.matches(layer) for spec in covering)]
    if not rest:
        notes.setdefault("", []).extend(f"{WATCH_SECTION}: {reason}" for reason in reasons.get(WATCH_SECTION, []))
        notes[""].append(
            f"{WATCH_SECTION} is not written: every layer of the run is selected by a section's LogTensorStats, which "
            "logs the watch's statistics too."
        )
        return
    name = free_name(WATCH_SECTION, taken)
    merged[name] = {**watch, "layers": {"exact_layer_names": rest}}
    notes[name] = [*reasons.get(WATCH_SECTION, []), *notes.get(name, [])]
    notes[name].append(
        "Restricted to the run's layers that no other section's LogTensorStats selects (those log the watch's "
        "statistics in their own sections)."
    )
