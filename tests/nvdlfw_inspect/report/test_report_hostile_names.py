"""Names from the logs that look like HTML, JSON escapes or the template's own markers reach the page as
data: its embedded JSON parses back to exactly the data, and the page still draws."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
from browser import CHROMIUM, dom

from nvdlfw_inspect.reading import RoutingRecord, Statistic, read_routing
from nvdlfw_inspect.report import render, report_data, write_report

HOSTILE = ["{{TITLE}}", "{{DATA}}", "/*DATA*/", "</script>", "<!--<script>", 'say "hi"', "back\\slash", "ünï €✓", "a|b&c"]
DATA_SCRIPT = re.compile(r'<script id="data" type="application/json">(.*?)</script>', re.DOTALL)


def embedded(page: str) -> dict:
    (payload,) = DATA_SCRIPT.findall(page)
    return json.loads(payload)


def title_of(page: str) -> str:
    return html.unescape(re.search(r"<title>(.*?)</title>", page, re.DOTALL).group(1))


def test_page_data_round_trips_exactly():
    stats = [Statistic(0, name, name, name, 0, 1.5) for name in HOSTILE]
    title = 'Statistics of C:\\logs\\"run" {{TITLE}} </script> ü'
    routing = [RoutingRecord(0, name, "fprop", name, "modified", name, True, 0) for name in HOSTILE]
    data = report_data(stats, title, routing=routing)
    assert data["precision_map"]["layers"] == HOSTILE
    page = render(data)
    assert embedded(page) == data
    assert title_of(page) == title
    assert "</script>" not in DATA_SCRIPT.search(page).group(1) and "<!--" not in DATA_SCRIPT.search(page).group(1)


def write_stats(log_dir: Path) -> None:
    path = log_dir / "nvdlfw_inspect_statistics_jsonl" / "nvdlfw_inspect_globalrank-0.jsonl"
    path.parent.mkdir(parents=True)
    records = [
        {"layer": name, "tensor": "activation", "stat": "max", "iteration": i, "value": i} for name in HOSTILE for i in range(3)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    routing = log_dir / "nvdlfw_inspect_routing_jsonl" / "routing_globalrank-0.jsonl"
    routing.parent.mkdir()
    records = [
        {"layer": name, "gemm": "wgrad", "tensor": "gradient", "decision": "high_precision", "feature": name, "recipe": True}
        for name in HOSTILE
    ]
    routing.write_text("".join(json.dumps(r | {"iteration": 0, "rank": 0}) + "\n" for r in records))


def test_log_dir_with_backslash_quotes_and_unicode(tmp_path):
    log_dir = tmp_path / 'run\\1 "quoted" ü {{TITLE}}'
    write_stats(log_dir)
    page = write_report(log_dir).read_text(encoding="utf-8")
    data = embedded(page)
    assert data["title"] == title_of(page) == f"Statistics of {log_dir.resolve()}"
    assert sorted(data["layers"]) == sorted(HOSTILE)


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (scripts/test.sh installs it)")
def test_page_with_hostile_names_draws(tmp_path):
    log_dir = tmp_path / 'run\\1 "quoted" ü'
    write_stats(log_dir)
    text, errors = dom(write_report(log_dir, tmp_path / "report.html"))
    assert errors == []
    assert 'data-ready="true"' in text
    assert "<h3>{{TITLE}}</h3>" in text and "<h3>&lt;/script&gt;</h3>" in text
    assert [record.layer for record in read_routing(log_dir)] == HOSTILE
    precision_map = re.search(r'<table id="precision-map">(.*?)</table>', text).group(1)
    assert '<a href="#layer-' in precision_map and "&lt;/script&gt;</a>" in precision_map and "<!--<script>" not in precision_map
    assert "high precision — &lt;!--&lt;script&gt;</div>" in precision_map  # a feature's name, escaped too
