"""Routing records: which GEMM of which layer read which tensor in FP8, in high precision or modified, which
feature decided, from which iteration; one record per change, and a failing write costs only its records."""

from __future__ import annotations

import errno
import os
import textwrap

import pytest
import torch
from debugrun import CURRENT, make_linear, section, start, train_step

import lowprec
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.logging import ROUTING_RECORDS_DIR, BaseLogger, get_logger
from nvdlfw_inspect.reading import RoutingRecord, read_routing, read_stats

KEEP_HIGH = """
from lowprec.debug.features.api import TEConfigAPIMapper
from nvdlfw_inspect.registry import Registry, api_method


@Registry.register_feature(namespace="transformer_engine")
class KeepHighFrom{tag}(TEConfigAPIMapper):
    uses_tensors = False
    option_keys = frozenset({{"start"}})

    @api_method
    def fp8_gemm_enabled(self, config, layer_name, gemm, iteration):
        start = config["start"]
        return (True, start) if iteration < start else (False, iteration + 1)
"""


@pytest.fixture
def keep_high(tmp_path, request):
    """A feature that keeps its GEMMs in high precision from iteration ``start`` on (fresh name per test)."""
    tag = request.node.name.replace("[", "_").replace("]", "_")[-40:]
    directory = tmp_path / f"feat_{tag}"
    directory.mkdir()
    (directory / f"keep_high_{tag}.py").write_text(textwrap.dedent(KEEP_HIGH.format(tag=tag)))
    return directory, f"KeepHighFrom{tag}"


def config(keep_high_name: str) -> dict:
    def section(layer: str, features: dict) -> dict:
        return {"enabled": True, "layers": {"layer_name_regex_pattern": layer}, "transformer_engine": features}

    return {
        "disable": section("fc1$", {"DisableFP8GEMM": {"enabled": True, "gemms": ["wgrad"]}}),
        "modify": section(
            "fc2$",
            {
                "FakeQuant": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"], "quant_format": "FP8E4M3"},
                "PerTensorScaling": {"enabled": True, "gemms": ["wgrad"], "tensors": ["gradient"]},
                "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]},
            },
        ),
        "later": section("fc3$", {keep_high_name: {"enabled": True, "gemms": ["dgrad"], "start": 3}}),
    }


def train(log_dir, keep_high, steps: int = 6, **kwargs) -> None:
    """Three layers; iteration 0 without a recipe, the others under current scaling."""
    directory, name = keep_high
    debug_api.initialize(config_file=config(name), feature_dirs=[lowprec.FEATURE_DIR, directory], log_dir=log_dir, **kwargs)
    torch.manual_seed(0)
    layers = [lowprec.Linear(16, 16, name=f"model.fc{i}") for i in (1, 2, 3)]
    for step in range(steps):
        x = torch.randn(4, 16)
        with lowprec.fp8_autocast(enabled=step > 0, fp8_recipe=CURRENT):
            for layer in layers:
                x = layer(x)
        x.sum().backward()
        debug_api.step()


GEMM_OPERANDS = [("activation", "fprop"), ("activation", "wgrad"), ("weight", "fprop"), ("weight", "dgrad")]
GEMM_OPERANDS += [("gradient", "dgrad"), ("gradient", "wgrad")]
SPEC = {"name": "Float8CurrentScaling"}  # the recipe as a precision plan writes it


def records_of(layer: str, iteration: int, recipe: bool, decided: dict) -> list[RoutingRecord]:
    """Every input operand's record of ``layer``: the default (FP8 under a recipe, else high precision) unless
    ``decided`` gives (tensor, GEMM) another (decision, feature); under the recipe, its format."""
    default = ("fp8", None) if recipe else ("high_precision", None)
    fmt = "fp8_current_scaling" if recipe else None
    spec = SPEC if recipe else None
    return [
        RoutingRecord(
            0, layer, gemm, tensor, *decided.get((tensor, gemm), default), recipe, iteration, format=fmt, recipe_spec=spec
        )
        for tensor, gemm in GEMM_OPERANDS
    ]


def test_records_say_each_decision_once_from_its_iteration(log_dir, keep_high):
    train(log_dir, keep_high)
    debug_api.end_debug()
    name = keep_high[1]
    without_recipe = {("activation", "fprop"): ("modified", "FakeQuant"), ("gradient", "wgrad"): ("modified", "PerTensorScaling")}
    expected = [
        *records_of("model.fc1", 0, False, {}),
        *records_of("model.fc2", 0, False, without_recipe),
        *records_of("model.fc3", 0, False, {}),
        *records_of("model.fc1", 1, True, {op: ("high_precision", "DisableFP8GEMM") for op in GEMM_OPERANDS if op[1] == "wgrad"}),
        *records_of("model.fc2", 1, True, without_recipe | {("weight", "fprop"): ("high_precision", "FakeQuant")}),
        *records_of("model.fc3", 1, True, {}),
        RoutingRecord(
            0, "model.fc3", "dgrad", "weight", "high_precision", name, True, 3, format="fp8_current_scaling", recipe_spec=SPEC
        ),
        RoutingRecord(
            0, "model.fc3", "dgrad", "gradient", "high_precision", name, True, 3, format="fp8_current_scaling", recipe_spec=SPEC
        ),
    ]
    assert read_routing(log_dir) == expected  # nothing repeated at iterations 2, 4 and 5, where nothing changed
    assert read_routing(log_dir / ROUTING_RECORDS_DIR) == expected
    first = (log_dir / ROUTING_RECORDS_DIR / "routing_globalrank-0.jsonl").read_text().splitlines()[0]
    assert first == (
        '{"layer": "model.fc1", "gemm": "fprop", "tensor": "activation", "decision": "high_precision", "feature": null, '
        '"recipe": false, "iteration": 0, "rank": 0}'
    )
    log = next((log_dir / "nvdlfw_inspect_logs").glob("*.log")).read_text()
    assert "model.fc1: Tensor: gradient, gemm wgrad - High precision" in log  # the text lines stay
    assert "model.fc2: Tensor: activation, gemm fprop - modify_tensor()" in log


def test_log_routing_checks_its_arguments_and_writes_nothing_before_initialize(log_dir):
    record = {"layer": "l", "gemm": "fprop", "tensor": "weight", "feature": None, "recipe": True, "iteration": 0}
    with pytest.raises(ValueError, match=r"decision must be one of \('fp8', 'high_precision', 'modified'\), got 'bf16'"):
        debug_api.log_routing(**record, decision="bf16")
    with pytest.raises(ValueError, match="gemm must be one of"):
        debug_api.log_routing(**record | {"gemm": "forward"}, decision="fp8")
    with pytest.raises(TypeError, match="recipe must be True or False"):
        debug_api.log_routing(**record | {"recipe": 1}, decision="fp8")
    debug_api.log_routing(**record, decision="fp8")  # no session: nothing written, nothing raised
    assert read_routing(log_dir) == []


def test_a_failing_routing_write_costs_only_its_records(log_dir, capsys):
    debug_api.initialize(config_file={"modify": config("-")["modify"]}, feature_dirs=[lowprec.FEATURE_DIR], log_dir=log_dir)
    routing_file = get_logger().routing_file

    def full_disk(data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    routing_file._write = full_disk
    layer = lowprec.Linear(16, 16, name="model.fc2")
    for _ in range(3):
        with lowprec.fp8_autocast(fp8_recipe=CURRENT):
            layer(torch.randn(4, 16)).sum().backward()
        debug_api.step()
    debug_api.end_debug()
    err = capsys.readouterr().err
    assert err.count("cannot write") == 1 and "routing_globalrank-0.jsonl" in err
    lost = "6 log lines were lost to write errors (the first: [Errno 28] No space left on device)"
    assert f"{lost}: 6 in {routing_file.path}" in err
    assert read_routing(log_dir) == []
    assert sorted(read_stats(log_dir).iteration.unique()) == [0, 1, 2]  # the statistics and the training went on


class Discard(BaseLogger):
    """A statistics logger in place of the default files."""

    def log_scalar(self, name, value, iteration, **kwargs):
        pass


def test_without_the_default_statistics_files_no_routing_records_and_the_log_says_so(log_dir):
    sections = {"modify": config("-")["modify"]}
    debug_api.initialize(config_file=sections, feature_dirs=[lowprec.FEATURE_DIR], log_dir=log_dir, statistics_logger=Discard())
    with lowprec.fp8_autocast(fp8_recipe=CURRENT):
        lowprec.Linear(16, 16, name="model.fc2")(torch.randn(4, 16)).sum().backward()
    debug_api.end_debug()
    assert not (log_dir / ROUTING_RECORDS_DIR).exists()
    log = next((log_dir / "nvdlfw_inspect_logs").glob("*.log")).read_text()
    assert log.count("routing records (which GEMM read which tensor in which precision) are written beside") == 1


def test_several_features_deciding_one_gemm_are_named_together(log_dir):
    features = {
        "DisableFP8GEMM": {"enabled": True, "gemms": ["fprop"]},
        "FakeQuant": {"enabled": True, "gemms": ["fprop"], "tensors": ["weight"], "quant_format": "FP8E4M3"},
    }
    start(section(features), log_dir)
    train_step(make_linear(), torch.randn(4, 32), torch.randn(4, 24))
    debug_api.end_debug()
    fprop = {r.tensor: (r.decision, r.feature) for r in read_routing(log_dir) if r.gemm == "fprop"}
    assert fprop == {"activation": ("high_precision", "DisableFP8GEMM+FakeQuant"), "weight": ("modified", "FakeQuant")}
