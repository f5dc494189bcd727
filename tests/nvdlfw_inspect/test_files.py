"""Files the commands write survive a full disk and an unwritable path: the command says in one line which
file and why, exits 1, and a previous file there stays whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from full_disk import NO_SPACE, fill_disk

from nvdlfw_inspect.cli import main
from nvdlfw_inspect.files import WriteError, write_text_atomic


def records(log_dir: Path, iterations: int = 4) -> None:
    """A run's structured statistics, written directly (no training needed to read them back)."""
    path = log_dir / "nvdlfw_inspect_statistics_jsonl" / "nvdlfw_inspect_globalrank-0.jsonl"
    path.parent.mkdir(parents=True)
    rows = [
        {"layer": "model.fc1", "tensor": "activation", "stat": "max", "iteration": it, "value": it + 1.0}
        for it in range(iterations)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_report_on_a_full_disk_keeps_the_previous_page(log_dir, monkeypatch, capsys):
    records(log_dir)
    assert main(["report", str(log_dir)]) == 0
    page = log_dir / "report.html"
    before = page.read_text()
    capsys.readouterr()
    fill_disk(monkeypatch)
    assert main(["report", str(log_dir)]) == 1
    err = capsys.readouterr().err
    assert err == f"nvdlfw-inspect report: cannot write the report to '{page}': {NO_SPACE}\n"
    assert page.read_text() == before and before.rstrip().endswith("</html>")
    assert sorted(p.name for p in log_dir.iterdir()) == ["nvdlfw_inspect_statistics_jsonl", "report.html"]  # no temporary


def test_report_to_an_unwritable_path_is_one_line(log_dir, tmp_path, capsys):
    records(log_dir)
    (tmp_path / "a_file").write_text("")
    output = tmp_path / "a_file" / "report.html"
    assert main(["report", str(log_dir), "-o", str(output)]) == 1
    err = capsys.readouterr().err
    assert err == f"nvdlfw-inspect report: cannot write the report to '{output}': Not a directory\n"


def test_write_text_atomic_replaces_only_a_complete_file(tmp_path, monkeypatch):
    path = tmp_path / "page.html"
    write_text_atomic(path, "old")
    fill_disk(monkeypatch)
    with pytest.raises(WriteError, match=f"cannot write the page to '{path}': {NO_SPACE}") as caught:
        write_text_atomic(path, "new and longer", "the page")
    assert isinstance(caught.value, OSError) and caught.value.errno == 28
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["page.html"]
