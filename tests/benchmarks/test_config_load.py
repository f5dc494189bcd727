"""benchmarks/config_load.py times initialize for both selector kinds and prints them (a small run here)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import config_load  # noqa: E402


def test_both_selector_kinds_are_timed_and_printed(capsys):
    args = argparse.Namespace(sections=300, repeats=1, no_reference=True)
    fastest, reason = config_load.measure(args)
    assert reason == "skipped (--no-reference)" and set(fastest) == {"ours exact", "ours regex"}
    assert all(math.isfinite(seconds) and seconds > 0 for seconds in fastest.values())
    config_load.print_table(args.sections, fastest, reason)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("initialize with 300 one-layer sections")
    assert (
        out[2].startswith("exact")
        and out[3].startswith("regex")
        and out[4] == "reference: not measured (skipped (--no-reference))"
    )


def test_the_config_has_one_section_per_layer_of_the_kind():
    exact, regex = config_load.config(3, "exact"), config_load.config(3, "regex")
    assert exact["layer_2"]["layers"] == {"exact_layer_names": ["model.layers.2.fc1"]}
    assert regex["layer_2"]["layers"] == {"layer_name_regex_pattern": r"layers\.2\.fc1$"}
