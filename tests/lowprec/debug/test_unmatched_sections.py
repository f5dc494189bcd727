"""A config section that selects no layer of a lowprec model is warned about once, naming the section and its
selectors: when ``infer_and_assign_layer_names`` names the model, else at the end of the first step."""

from __future__ import annotations

import torch
import yaml
from debugrun import section, start

import lowprec
import nvdlfw_inspect
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect import cli

STATS = {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]}}


def sequential() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(lowprec.Linear(16, 16), torch.nn.ReLU(), lowprec.Linear(16, 16))


def train(model: torch.nn.Module, steps: int = 2) -> None:
    for _ in range(steps):
        with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
            model(torch.randn(4, 16)).sum().backward()
        debug_api.step()


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if "selects no layer" in line]


def test_a_section_for_layers_the_model_lacks_is_warned_about_when_the_model_is_named(log_dir, capsys):
    start(section(STATS, {"layer_types": ["fc1"]}), log_dir)
    model = sequential()
    debug_api.infer_and_assign_layer_names(model)
    (warning,) = warnings_in(capsys.readouterr().err)
    assert "section 'sec' selects no layer: its selectors {'layer_types': ['fc1']} match none of the 4 layers" in warning
    assert "(model, model.0 [linear], model.1, model.2 [linear]); its features do nothing" in warning
    train(model)
    debug_api.end_debug()
    assert warnings_in(capsys.readouterr().err) == []  # once: not again at the first step
    assert warning.split(" - WARNING - ")[1] in (log_dir / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    assert nvdlfw_inspect.read_stats(log_dir).empty


def test_without_naming_the_first_step_warns_with_the_layers_that_called(log_dir, capsys):
    start(section(STATS, {"layer_types": ["fc1"]}), log_dir)
    model = sequential()
    model[0].name, model[2].name = "model.0", "model.2"
    train(model, steps=1)
    (warning,) = warnings_in(capsys.readouterr().err)
    assert (
        "match none of the 2 layers that called the debug API in the first step (model.0 [linear], model.2 [linear])" in warning
    )
    train(model, steps=2)
    assert warnings_in(capsys.readouterr().err) == []


def test_sections_that_select_a_layer_by_name_or_declared_type_are_not_warned_about(log_dir, capsys):
    config = {
        **section(STATS, {"layer_types": ["fc1"]}),
        "linear": {
            "enabled": True,
            "layers": {"layer_types": ["linear"]},
            "transformer_engine": {"DisableFP8GEMM": {"enabled": True, "gemms": ["wgrad"]}},
        },
    }
    start(config, log_dir)
    model = torch.nn.Sequential(lowprec.LayerNormMLP(16, 32), lowprec.Linear(16, 16))  # its fc1 and fc2 are debug layers
    debug_api.infer_and_assign_layer_names(model)
    train(model)
    assert warnings_in(capsys.readouterr().err) == []
    assert set(nvdlfw_inspect.read_stats(log_dir).layer) == {"model.0.fc1"}


def namespace_warnings_in(err: str) -> list[str]:
    return [line.split(" - WARNING - ")[1] for line in err.splitlines() if "called the debug API only in namespace" in line]


def test_base_features_on_lowprec_layers_are_warned_about_naming_the_namespace_to_use(log_dir, capsys, recwarn):
    """``LogTensorStats`` written in the section (the Quick start's form) is the ``base`` namespace's; lowprec layers
    call ``transformer_engine``, so it logs nothing for them. Layers that do call ``base`` are not named."""
    config = {
        "quick_start_form": {
            "enabled": True,
            "layers": {"exact_layer_names": ["model.0", "model.own"]},
            "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]},
        },
        **section(STATS, {"exact_layer_names": ["model.2"]}),
    }
    start(config, log_dir)
    model = sequential()
    model[0].name, model[2].name = "model.0", "model.2"
    for _ in range(2):
        debug_api.log_tensor_stats("model.own", tensor=torch.ones(4), tensor_name="activation")
        train(model, steps=1)
    err = capsys.readouterr().err
    assert namespace_warnings_in(err) == [
        "config dict: section 'quick_start_form' configures ['LogTensorStats'] of namespace 'base' (written directly in "
        "the section), but 1 layer it selects (model.0) called the debug API only in namespace 'transformer_engine'; "
        "these features do nothing for it; write them under 'transformer_engine:' in the section"
    ]
    assert [str(w.message) for w in recwarn if "quick_start_form" in str(w.message)] == namespace_warnings_in(err)
    debug_api.end_debug()
    assert set(nvdlfw_inspect.read_stats(log_dir).layer) == {"model.own", "model.2"}


def test_a_transformer_engine_section_no_layer_called_names_lowprec_convert_for_a_plain_model(log_dir, recwarn):
    start(section(STATS), log_dir)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    train(plain, steps=2)
    (warning,) = [str(w.message) for w in recwarn if "selects no layer" in str(w.message)]
    assert warning == (
        "config dict: section 'sec' selects no layer: its selectors {'layer_name_regex_pattern': '.*'} match no layer: "
        "none called the debug API in the first step (are its layers debuggable and named? transformer_engine features "
        "are called by Transformer Engine or lowprec layers: if the model is plain PyTorch, convert it first with "
        "model = lowprec.convert(model)); its features do nothing"
    )
    debug_api.end_debug()
    assert warning in (log_dir / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()


def test_validate_layers_from_says_base_features_do_nothing_for_the_runs_lowprec_layers(log_dir, tmp_path, capsys):
    """What the run warned about, ``validate --layers-from`` says too: the routing records show which layers a
    library routed (``model.0``, ``model.2``); ``model.own`` called ``base`` itself and is not named."""
    config = {
        "quick_start_form": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": r"model\.(0|own)$"},
            "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]},
        },
        **section(STATS, {"exact_layer_names": ["model.2"]}),
    }
    start(config, log_dir, default_logging_enabled=True)
    model = sequential()
    model[0].name, model[2].name = "model.0", "model.2"
    debug_api.log_tensor_stats("model.own", tensor=torch.ones(4), tensor_name="activation")
    train(model, steps=1)
    debug_api.end_debug()
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    capsys.readouterr()
    assert cli.main(["validate", str(path), "--layers-from", str(log_dir)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == f"{path}: valid (and on the 3 layers logged in {log_dir}), 1 warning"
    assert err.splitlines() == [
        f"{path}: warning: section 'quick_start_form' configures ['LogTensorStats'] of namespace 'base' (written "
        "directly in the section), but 1 layer of the run it selects (model.0) had its GEMMs routed by a library, "
        "which calls its own namespace, not 'base': these features do nothing for it; write them under "
        "'transformer_engine:' in the section"
    ]
