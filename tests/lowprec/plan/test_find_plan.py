"""``find_plan`` end to end on a small model with a planted sensitive layer (``tests/support/planted_plan.py``):
NVFP4 everywhere is measured outside the budget, the plan found keeps the planted GEMM wider, puts most GEMMs in
NVFP4 and is measured within the budget, and its files (plan, page, result) are written and load."""

from __future__ import annotations

import json

import pytest
import yaml
from browser import CHROMIUM, dom

from lowprec.plan import load_plan, named_recipe
from lowprec.plan.search import GEMMS
from lowprec.planner.find import find_plan
from lowprec.planner.page import FORMAT_COLOURS
from nvdlfw_inspect.diagnose import diagnose
from nvdlfw_inspect.diagnose.formats import TENSOR_GEMMS


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    return out, find_plan(model="planted_plan:factory", candidates=["nvfp4", "mxfp8"], steps=20, seeds=3, out=out, threads=1)


def test_the_plan_keeps_the_sensitive_gemm_wide_and_trains_within_the_budget_where_nvfp4_everywhere_does_not(found):
    out, result = found
    assert result.budget == pytest.approx(result.noise) and result.noise > 0  # 1 x the seed-to-seed spread
    assert result.cheapest == "nvfp4" and result.cheapest_gap > 4 * result.budget  # NVFP4 everywhere: far outside
    final = result.final
    assert final.within_budget and final.measured_gap <= result.budget
    assert final.formats["model.b"]["fprop"] != "nvfp4"  # the outlier channel's GEMM
    gemms = [fmt for layer in final.formats.values() for fmt in layer.values()]
    assert len(gemms) == 9 and gemms.count("nvfp4") >= 4
    assert final.cost < 3 * 8.25 / 16  # cheaper than MXFP8 everywhere
    assert all(not r.within_budget for r in result.rounds[:-1])
    for earlier in result.rounds[:-1]:  # a round that missed: the damage model scaled by what it under-predicted
        assert earlier.rescaled == pytest.approx(earlier.measured_gap / earlier.predicted_gap)


def test_the_layer_the_diagnosis_flags_in_nvfp4_everywhere_is_kept_wider_by_the_plan(found):
    """``diagnose`` on the NVFP4-everywhere baseline flags the planted layer's activation; the plan keeps a GEMM
    that reads each flagged tensor wider than NVFP4 (the activation's fprop, which reads it rowwise)."""
    out, result = found
    findings = diagnose(out / "baselines" / "nvfp4" / "seed0").findings
    flagged = {(f.layer, f.tensor) for f in findings}
    assert ("model.b", "activation") in flagged and result.final.formats["model.b"]["fprop"] != "nvfp4"
    for layer, tensor in flagged:
        assert any(result.final.formats[layer][g] != "nvfp4" for g in TENSOR_GEMMS[tensor]), (layer, tensor)


def test_the_plan_file_loads_and_gives_each_gemm_its_format_and_the_page_and_result_are_written(found):
    out, result = found
    plan = load_plan(str(out / "plan.yaml"))
    for layer, gemms in result.final.formats.items():
        recipes = plan.resolve(layer).gemm_recipes(True, None)
        for gemm in GEMMS:
            fmt = gemms[gemm]
            assert recipes.of(gemm) == (None if fmt == "bf16" else named_recipe(fmt)), (layer, gemm)
    assert "precision_plan" in yaml.safe_load((out / "plan.yaml").read_text())
    data = json.loads((out / "plan.json").read_text())
    assert data["within_budget"] is True and data["kappa"] == pytest.approx(result.kappa)
    page = (out / "plan.html").read_text()
    assert "Pareto front" in page and "model.b" in page and "within the budget" in page
    assert (out / "calibration.json").is_file() and (out / "baselines" / "compare.html").is_file()


def test_the_command_refuses_bad_input_before_training(tmp_path, capsys):
    from lowprec.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "--formats", "fp3,nvfp4", "--out", str(tmp_path)])
    assert "unknown format fp3" in capsys.readouterr().err
    assert main(["plan", "--seeds", "1", "--out", str(tmp_path)]) == 1
    assert "seeds must be at least 2" in capsys.readouterr().err
    assert not (tmp_path / "calibration.json").exists()
    (tmp_path / "plan.json").write_text("{}")  # an earlier search's
    assert main(["plan", "--out", str(tmp_path)]) == 1
    assert "holds an earlier plan search (plan.json)" in capsys.readouterr().err


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (scripts/test.sh installs it)")
def test_the_page_loads_in_a_browser_with_the_front_and_the_map(found):
    out, result = found
    html, errors = dom(out / "plan.html")
    assert errors == []
    assert html.count("<circle") == len(result.front) + 1  # every front point, and the chosen plan ringed
    assert 'aria-label="Pareto front"' in html and ">budget</text>" in html
    for gemms in result.final.formats.values():
        for fmt in gemms.values():
            assert f'background:{FORMAT_COLOURS[fmt]};color:#fff">{fmt}</td>' in html
    assert html.count('href="') >= len(result.rounds) + 1  # each round's compare page and the baselines


def test_formats_a_gpu_has_no_speed_for_are_dropped_with_a_warning(tmp_path):
    from lowprec.errors import LowprecValueError

    with pytest.warns(UserWarning, match="h100 has no published speed for nvfp4, mxfp8"):
        with pytest.raises(LowprecValueError, match="none but bf16 runs on h100"):
            find_plan(candidates=["nvfp4", "mxfp8"], gpu="h100", out=tmp_path)
