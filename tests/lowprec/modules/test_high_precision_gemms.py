"""GEMMs that run in high precision under an FP8 autocast outside any lowprec layer (a tied head, ``x @ self.W``,
``F.linear`` on a Parameter, a module ``convert`` skipped) are said once each, with the fix, in the debug log and as
a warning, and get routing records the report's precision map shows; an autocast with no lowprec layer says so.
The watch looks at the first forward only: later steps run without its hooks and dispatch mode."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from browser import CHROMIUM, dom
from torch.nn.modules import module as torch_module
from torch.utils._python_dispatch import _get_current_dispatch_mode

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.debug.names import TENSOR_GEMMS
from nvdlfw_inspect.reading import read_routing
from nvdlfw_inspect.report import write_report
from nvdlfw_inspect.report.precision_map import precision_map

CURRENT = lowprec.Float8CurrentScaling()
MHA_REASON = "its projections run in F.multi_head_attention_forward, which reads the weights directly"


class TiedModel(torch.nn.Module):
    """Every way a GEMM escapes a converted model, beside a converted layer and one the filter keeps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 16)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)  # convert skips it
        self.fc = torch.nn.Linear(16, 16)  # converted; the config keeps its GEMMs in high precision
        self.W = torch.nn.Parameter(torch.randn(16, 16) * 0.1)
        self.proj_weight = torch.nn.Parameter(torch.randn(16, 16) * 0.1)
        self.V = torch.nn.Parameter(torch.randn(16, 16) * 0.1)
        self.head = torch.nn.Linear(16, 16)  # filtered out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = self.fc(h) @ self.W
        h = F.linear(h, self.proj_weight)
        with lowprec.autocast(enabled=False):  # high precision asked for: not reported
            h = h @ self.V
        h = self.head(h)
        return h @ self.emb.weight.T  # the tied head


def config() -> dict:
    features = {
        "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]},
        "DisableFP8GEMM": {"enabled": True, "gemms": ["fprop", "dgrad", "wgrad"]},
    }
    return {"fc": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc$"}, "transformer_engine": features}}


def train(model: torch.nn.Module, steps: int = 3) -> list[str]:
    """``steps`` steps of ``model``, each forward in its own autocast; the warnings the autocasts gave."""
    ids = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            with lowprec.fp8_autocast(fp8_recipe=CURRENT):
                out = model(ids)
            out.square().mean().backward()
            debug_api.step()
    return [str(w.message) for w in caught if str(w.message).startswith("lowprec.autocast")]


def debug_log(log_dir) -> str:
    return (log_dir / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()


def test_gemms_outside_lowprec_layers_are_said_once_each_with_the_fix_and_recorded(log_dir, tmp_path):
    debug_api.initialize(config_file=config(), feature_dirs=[lowprec.FEATURE_DIR], log_dir=log_dir)
    model = lowprec.convert(TiedModel(), exclude="head")
    said = train(model)
    debug_api.end_debug()

    stray = {"model.W", "model.proj_weight", "model.emb.weight"}
    per_parameter = {re.search(r"read the Parameter (\S+) in high precision", message): message for message in said}
    assert {found.group(1) for found in per_parameter if found} == stray  # not fc's, V's (autocast off) or head's
    for message in said:
        if "read the Parameter" in message:
            assert "no lowprec layer runs that GEMM" in message and "Fix: compute it with a lowprec layer" in message
            assert "accept high precision" in message
    (mha,) = [message for message in said if message.startswith("lowprec.autocast: model.attn (MultiheadAttention)")]
    assert "in_proj_weight" in mha and "out_proj.weight" in mha and "out_proj.bias" not in mha and MHA_REASON in mha
    assert len(said) == 4  # once each, over three steps
    log = debug_log(log_dir)
    assert all(log.count(message) == 1 for message in said)

    records = {}
    for record in read_routing(log_dir):
        records.setdefault(record.layer, set()).add((record.gemm, record.tensor, record.decision, record.reason))
    operands = {(gemm, tensor) for tensor in ("activation", "weight", "gradient") for gemm in TENSOR_GEMMS[tensor]}
    for layer, reason in [
        ("model.attn", f"not converted: {MHA_REASON}"),
        ("model.head", "filtered out of lowprec.convert"),
        *((name, "not in a lowprec layer: aten.mm") for name in stray),
    ]:
        assert records[layer] == {(gemm, tensor, "high_precision", reason) for gemm, tensor in operands}, layer
    assert {decision for _, _, decision, _ in records["model.fc"]} == {"high_precision"}  # the lowprec layer's own
    assert "model.V" not in records

    data = precision_map(read_routing(log_dir))
    attn = data["cells"][data["layers"].index("model.attn")]
    assert [period["parts"] for gemm in attn for period in gemm] == [
        [
            {"tensor": t, "decision": "high_precision", "feature": None, "recipe": True, "reason": f"not converted: {MHA_REASON}"}
            for t in tensors
        ]
        for tensors in (["activation", "weight"], ["weight", "gradient"], ["activation", "gradient"])
    ]
    page = write_report(log_dir, tmp_path / "report.html").read_text()
    embedded = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S).group(1))
    assert embedded["precision_map"] == data


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (scripts/test.sh installs it)")
def test_the_page_shows_a_skipped_module_in_high_precision_with_the_reason(log_dir, tmp_path):
    debug_api.initialize(config_file=config(), feature_dirs=[lowprec.FEATURE_DIR], log_dir=log_dir)
    train(lowprec.convert(TiedModel(), exclude="head"), steps=1)
    debug_api.end_debug()
    html, errors = dom(write_report(log_dir, tmp_path / "report.html"))
    assert errors == []
    row = re.search(r"<tr><td>(?:<[^>]+>)*model\.attn(?:<[^>]+>)*</td>(.*?)</tr>", html).group(1)
    assert row.count(f'<div class="route route-hp">high precision \u2014 not converted: {MHA_REASON}</div>') == 3


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def watching() -> tuple[int, bool]:
    """The global module hooks registered and whether a dispatch mode is active."""
    return len(torch_module._global_forward_pre_hooks) + len(torch_module._global_forward_hooks), (
        _get_current_dispatch_mode() is not None
    )


@pytest.mark.parametrize("one_autocast", [False, True], ids=["an autocast per step", "one autocast around the loop"])
def test_the_watch_leaves_no_hook_nor_dispatch_mode_after_the_first_forward(log_dir, one_autocast):
    debug_api.initialize(config_file=config(), feature_dirs=[lowprec.FEATURE_DIR], log_dir=log_dir)
    model = lowprec.convert(Mlp())
    seen = []
    model.fc2.register_forward_hook(lambda *_: seen.append(watching()))
    with lowprec.fp8_autocast(enabled=one_autocast, fp8_recipe=CURRENT):
        for _ in range(3):
            with lowprec.fp8_autocast(fp8_recipe=CURRENT):
                model(torch.randn(4, 8)).sum().backward()
            debug_api.step()
    assert seen == [(2, True), (0, False), (0, False)]
    assert watching() == (0, False)


def test_an_autocast_around_a_model_without_lowprec_layers_says_so_once_naming_convert(log_dir):
    debug_api.initialize(config_file=config(), feature_dirs=[lowprec.FEATURE_DIR], log_dir=log_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with lowprec.fp8_autocast(fp8_recipe=CURRENT):
                Mlp()(torch.randn(4, 8)).sum().backward()
            debug_api.step()
    said = [str(w.message) for w in caught if str(w.message).startswith("lowprec.autocast")]
    assert said == [
        "lowprec.autocast: no lowprec layer ran inside it, so nothing ran in FP8; GEMMs read model.fc1.weight, "
        "model.fc2.weight in high precision. Fix: convert the model first, model = lowprec.convert(model), or build "
        "it from lowprec layers"
    ]
    debug_api.end_debug()
    assert debug_log(log_dir).count(said[0]) == 1
    reasons = {(record.layer, record.reason) for record in read_routing(log_dir)}
    assert reasons == {
        ("model.fc1.weight", "not in a lowprec layer: aten.addmm"),
        ("model.fc2.weight", "not in a lowprec layer: aten.addmm"),
    }
