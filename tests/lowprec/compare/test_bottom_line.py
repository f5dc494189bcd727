"""``compare``'s answers: each format judged by its own thresholds, a bottom line per recipe against high
precision and its seed-to-seed noise, the user's own model, and runs that already exist compared without training."""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path

import pytest
from compare_model import make

from lowprec.cli import main
from lowprec.compare import compare_dirs, compare_formats
from lowprec.compare.bottom import bottom_line, final_loss
from lowprec.compare.outliers import over_thresholds
from nvdlfw_inspect.diagnose.formats import Formats
from nvdlfw_inspect.diagnose.thresholds import Thresholds
from nvdlfw_inspect.reading import RoutingRecord, Statistic


def page_data(page: Path) -> dict:
    match = re.search(r'<script type="application/json" id="compare-data">(.*?)</script>', page.read_text(), re.S)
    return json.loads(match.group(1))


def test_final_loss_is_the_mean_of_the_last_tenth():
    assert final_loss([9.0] * 15 + [2.0, 4.0]) == 3.0  # 17 losses: the last ceil(1.7) = 2
    assert final_loss([5.0, 1.0]) == 1.0 and final_loss([1.0, float("nan")]) != final_loss([1.0, float("nan")])


def test_each_tensor_is_judged_by_its_own_layers_format():
    """A plan run: fc1 in NVFP4 and fc2 in MXFP8, both at 20% underflow; the routing records name each layer's format."""
    stats = [Statistic(0, layer, "gradient", "underflows%", it, 20.0) for layer in ("fc1", "fc2") for it in range(4)]
    records = [
        RoutingRecord(0, layer, gemm, tensor, "quantized", None, True, 0, format=fmt)
        for layer, fmt in (("fc1", "nvfp4"), ("fc2", "mxfp8"))
        for gemm, tensor in (("dgrad", "gradient"), ("wgrad", "gradient"), ("fprop", "activation"))
    ]
    verdict = over_thresholds(stats, formats=Formats(records, Thresholds()))["underflows%"]
    assert verdict["over"] == 1 and verdict["of"] == 2 and verdict["worst"] == 20.0  # fc2 only: MXFP8's 1%
    assert {name: used["pct"] for name, used in verdict["thresholds"].items()} == {"NVFP4": 25.1, "MXFP8": 1.0}
    alone = over_thresholds(stats, label="mxfp4")["underflows%"]  # no records: the run's own format, MXFP4's 33.9%
    assert alone["over"] == 0 and alone["thresholds"]["MXFP4"]["pct"] == 33.9


def test_the_bottom_line_compares_the_gap_with_twice_the_seed_noise():
    base = {"name": "bf16", "finals": {0: 2.0, 1: 2.1, 2: 1.9}, "outliers": {}}
    rows = [{"layer": "model.fc2", "tensor": "gradient", "settled": 0.25}]
    far = {"name": "nvfp4", "finals": {0: 2.3, 1: 2.4, 2: 2.2}, "outliers": {"relative mse": rows}}
    line = bottom_line(far, base, "high precision (bf16)")
    noise = statistics.stdev([2.0, 2.1, 1.9]) / 2.0
    assert line["gap"] == pytest.approx(0.15) and line["noise"] == pytest.approx(noise) and line["outside"] is True
    assert line["text"] == (
        f"nvfp4: final loss +15.0% vs high precision (bf16), outside the seed-to-seed spread of high precision (bf16) "
        f"(2 x {noise:.2%} = {2 * noise:.2%}, 3 seeds); most of the error from (relative mse): model.fc2 gradient (0.25)"
    )
    near = {"name": "mxfp8", "finals": {0: 2.1, 1: 2.1, 2: 1.9}, "outliers": {}}
    assert bottom_line(near, base, "bf16")["outside"] is False and "within" in bottom_line(near, base, "bf16")["text"]
    one = bottom_line({**far, "finals": {0: 2.2}}, {**base, "finals": {0: 2.0}}, "bf16")
    assert one["noise"] is None and "one seed: no noise estimate, run --seeds 3 to get one" in one["text"]


@pytest.fixture(scope="module")
def own_model(tmp_path_factory) -> Path:
    """The two-layer model of ``compare_model`` trained under fp32 and MXFP8, two seeds each."""
    out = tmp_path_factory.mktemp("own")
    compare_formats(["fp32", "mxfp8"], steps=6, out=out, seeds=2, device="cpu", threads=1, model="compare_model:make")
    return out


def test_the_users_model_trains_per_recipe_and_seed_with_a_bottom_line(own_model, capsys):
    data = page_data(own_model / "compare.html")
    assert data["seeds"] == [0, 1] and [run["name"] for run in data["runs"]] == ["fp32", "mxfp8"]
    finals = {}
    for run in data["runs"]:
        for seed in (0, 1):
            losses = json.loads((own_model / run["name"] / f"seed{seed}" / "loss.json").read_text())["loss"]
            assert len(losses) == 6 and run["finals"][str(seed)] == final_loss(losses)
        finals[run["name"]] = [run["finals"]["0"], run["finals"]["1"]]
        assert run["loss"][0] == pytest.approx(statistics.fmean(run_first(own_model, run["name"])))
    assert finals["fp32"][0] != finals["fp32"][1]  # another seed: other weights and batches
    mxfp8 = data["runs"][1]
    assert {row["layer"] for row in mxfp8["outliers"]["relative mse"]} == {"model.fc1", "model.fc2"}  # every layer: .*
    (line,) = data["bottom_lines"]
    base_mean = statistics.fmean(finals["fp32"])
    gap = statistics.fmean(m - b for m, b in zip(finals["mxfp8"], finals["fp32"], strict=True)) / base_mean
    assert line["gap"] == pytest.approx(gap) and line["noise"] == pytest.approx(statistics.stdev(finals["fp32"]) / base_mean)
    assert line["text"].startswith(f"mxfp8: final loss {gap:+.1%} vs high precision (fp32), ")
    assert "2 seeds)" in line["text"] and "model.fc" in line["text"]
    assert "<h2>Bottom line</h2><ul><li>mxfp8: final loss" in (own_model / "compare.html").read_text()


def run_first(out: Path, name: str) -> list[float]:
    return [json.loads((out / name / f"seed{k}" / "loss.json").read_text())["loss"][0] for k in (0, 1)]


def test_existing_runs_are_compared_without_training(own_model, tmp_path, capsys):
    """Run directories named by the user: the high-precision one is the baseline, a directory without statistics
    and a run without loss.json are said once each; nothing trains."""
    (tmp_path / "bare").mkdir()
    shutil.copytree(own_model / "mxfp8" / "seed1", tmp_path / "mx_noloss", ignore=shutil.ignore_patterns("loss.json"))
    runs = [own_model / "mxfp8" / "seed0", tmp_path / "bare", tmp_path / "mx_noloss", own_model / "fp32" / "seed1"]
    shutil.copytree(own_model / "fp32" / "seed0", tmp_path / "fp32")
    runs[0] = shutil.copytree(runs[0], tmp_path / "mxfp8")
    runs[3] = tmp_path / "fp32"
    assert main(["compare", *map(str, runs), "--out", str(tmp_path / "page")]) == 0
    out = capsys.readouterr().out
    assert out.count("skipped") == 1 and f"{tmp_path / 'bare'}: skipped, no statistics in " in out
    assert "give a run directory a debug run wrote" in out
    assert f"{tmp_path / 'mx_noloss'}: no loss.json: no loss curve or loss gap for it" in out
    data = page_data(tmp_path / "page" / "compare.html")
    assert [run["name"] for run in data["runs"]] == ["mxfp8", "mx_noloss", "fp32"] and data["baseline_run"] == "fp32"
    assert data["runs"][0]["label"] == "MXFP8" and data["runs"][2]["label"] == "high precision"
    trained = page_data(own_model / "compare.html")["bottom_lines"][0]
    lines = {line["name"]: line for line in data["bottom_lines"]}
    gap = (data["runs"][0]["finals"]["0"] - data["runs"][2]["finals"]["0"]) / data["runs"][2]["finals"]["0"]
    assert lines["mxfp8"]["gap"] == pytest.approx(gap) and trained["gap"] != gap  # one seed, not the mean of two
    assert "one seed: no noise estimate" in lines["mxfp8"]["text"]
    assert lines["mx_noloss"]["gap"] is None and "no loss shared with high precision (fp32)" in lines["mx_noloss"]["text"]
    assert not (tmp_path / "mxfp8" / "compare.html").exists()


def test_no_high_precision_run_compares_with_the_first(own_model, tmp_path):
    page = compare_dirs([own_model / "mxfp8" / "seed0", own_model / "mxfp8" / "seed1"], tmp_path)
    (line,) = page_data(page)["bottom_lines"]
    assert line["name"] == "seed1" and "no high-precision run: compared with the first run, seed0" in line["text"]


def test_bad_input_is_named(own_model, tmp_path, capsys):
    assert main(["compare", str(own_model / "fp32" / "seed0"), "--steps", "3", "--seeds", "2"]) == 1
    assert "--steps, --seeds only apply when compare trains (give no DIR)" in capsys.readouterr().err
    run = own_model / "fp32" / "seed0"
    assert main(["compare", str(run), "--out", str(run / "page")]) == 1
    assert f"--out {str(run / 'page')!r} is inside the input run {run}" in capsys.readouterr().err
    assert main(["compare", "--model", "compare_model", "--out", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert "--model must be module:function" in err and "got 'compare_model'" in err
    with pytest.raises(
        ValueError, match=r"--model 'compare_model:not_a_pair': .* must return \(model, batch_fn\).*returned TwoLayers"
    ):
        compare_formats(["fp32"], steps=1, out=tmp_path / "b", model="compare_model:not_a_pair")
    with pytest.raises(ValueError, match=r"--model 'compare_model:nothing': module 'compare_model' has no attribute"):
        compare_formats(["fp32"], steps=1, out=tmp_path / "c", model="compare_model:nothing")
    with pytest.raises(ValueError, match=r"seeds \(--seeds\) must be a positive integer, got 0"):
        compare_formats(["fp32"], steps=1, out=tmp_path / "d", seeds=0, model=make)
    assert not any((tmp_path / name).exists() for name in "bcd")  # refused before anything ran
