"""``find_plan`` on the demo GPT (``tiny``, 30 steps, 2 seeds, budget 0.3 x high precision's seed-to-seed spread):
NVFP4 everywhere is measured outside the budget, the plan found is measured within it with most GEMMs in NVFP4,
and it keeps the output head's forward wider, as the published recipes keep the head (DeepSeek-V3; NVIDIA's NVFP4
recipe's high-precision tail). Deterministic: fixed seeds, one thread, stochastic rounding hashed from the seed."""

from __future__ import annotations

import pytest

from lowprec.planner.find import find_plan
from nvdlfw_inspect.diagnose import diagnose
from nvdlfw_inspect.diagnose.formats import TENSOR_GEMMS


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_plan")
    result = find_plan(candidates=["nvfp4", "mxfp8"], steps=30, seeds=2, budget=0.3, rounds=1, out=out, threads=1)
    return out, result


def test_on_the_demo_gpt_the_plan_trains_within_the_budget_where_nvfp4_everywhere_does_not(found):
    out, result = found
    assert result.cheapest == "nvfp4" and result.cheapest_gap > result.budget
    final = result.final
    assert final.within_budget and final.measured_gap <= result.budget
    gemms = [fmt for layer in final.formats.values() for fmt in layer.values()]
    assert len(gemms) == 27 and gemms.count("nvfp4") >= 18  # most GEMMs in the cheapest format
    assert final.formats["gpt.head"]["fprop"] != "nvfp4"
    for finding in diagnose(out / "baselines" / "nvfp4" / "seed0").findings:  # what the diagnosis flags stays wider
        assert any(final.formats[finding.layer][g] != "nvfp4" for g in TENSOR_GEMMS[finding.tensor]), finding.message
