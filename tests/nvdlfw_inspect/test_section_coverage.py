"""Sections that select no layer are warned about once each: when ``infer_and_assign_layer_names`` names a
model (their selectors match none of its names), else at the end of the first ``step()`` (no layer that called
the debug API matched them)."""

from __future__ import annotations

import torch

import nvdlfw_inspect.api as debug_api

STATS = {"enabled": True, "tensors": ["activation"], "stats": ["max"]}


def config(**layers: dict) -> dict:
    return {name: {"enabled": True, "layers": selector, "LogTensorStats": STATS} for name, selector in layers.items()}


def warnings_in(err: str) -> list[str]:
    return [line.split(" - WARNING - ")[1] for line in err.splitlines() if "selects no layer" in line]


def call(layer_name: str) -> None:
    debug_api.log_tensor_stats(layer_name, tensor=torch.ones(4), tensor_name="activation")


def test_the_first_step_warns_once_about_each_section_no_layer_matched(log_dir, capsys):
    debug_api.initialize(
        config(
            used={"exact_layer_names": ["model.fc1"]}, typo={"exact_layer_names": ["model.fc3"]}, other={"layer_types": ["attn"]}
        ),
        log_dir=log_dir,
    )
    call("model.fc1")
    call("model.fc2")
    debug_api.step()
    layers = "match none of the 2 layers that called the debug API in the first step"
    assert warnings_in(capsys.readouterr().err) == [
        f"config dict: section 'typo' selects no layer: its selectors {{'exact_layer_names': ['model.fc3']}} {layers} "
        "(did you mean 'model.fc2' or 'model.fc1'? all: model.fc1, model.fc2); its features do nothing",
        f"config dict: section 'other' selects no layer: its selectors {{'layer_types': ['attn']}} {layers} "
        "(model.fc1, model.fc2); its features do nothing",
    ]
    call("model.fc1")
    debug_api.step()
    assert warnings_in(capsys.readouterr().err) == []


def test_the_layer_meant_is_named_first_not_hidden_in_a_long_list(log_dir, capsys):
    """A wrapper (Lightning, PEFT) adds a prefix to every name: the layer written is the one ending with it, shown
    before the 12 names of the list, where it would be among the "... 28 more"."""
    debug_api.initialize(config(wrapped={"exact_layer_names": ["model.layers.9.fc", "model.layers.3.fc"]}), log_dir=log_dir)
    for i in range(40):
        call(f"model.model.layers.{i}.fc")
    debug_api.step()
    (warning,) = warnings_in(capsys.readouterr().err)
    assert warning.startswith(
        "config dict: section 'wrapped' selects no layer: its selectors {'exact_layer_names': ['model.layers.9.fc', "
        "'model.layers.3.fc']} match none of the 40 layers that called the debug API in the first step (did you mean "
        "'model.model.layers.3.fc' or 'model.model.layers.9.fc'? all: model.model.layers.0.fc, "
    )
    assert warning.endswith("model.model.layers.11.fc, ... 28 more); its features do nothing")


def test_a_first_step_without_any_layer_says_so(log_dir, capsys):
    debug_api.initialize(config(only={"layer_types": ["fc1"]}), log_dir=log_dir)
    debug_api.step()
    (warning,) = warnings_in(capsys.readouterr().err)
    assert warning.endswith(
        "match no layer: none called the debug API in the first step (are its layers debuggable and named?); "
        "its features do nothing"
    )


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 4)
        self.attn = torch.nn.Linear(4, 4)


class Fused(torch.nn.Module):
    """Calls the debug API under names of its own, with a declared type."""

    def debug_layers(self) -> list[tuple[str, tuple[str, ...]]]:
        return [(f"{self.name}.gate", ("gated",))]


def test_naming_a_model_warns_about_sections_matching_none_of_its_names(log_dir, capsys):
    debug_api.initialize(
        config(
            numbers={"layer_numbers": [7], "layer_types": ["fc1"]},
            named={"layer_types": ["fc1"]},
            declared={"layer_types": ["gated"]},
            sub={"exact_layer_names": ["model.block.attn"]},
        ),
        log_dir=log_dir,
    )
    model = torch.nn.Sequential()
    model.add_module("block", Block())
    model.add_module("fused", Fused())
    debug_api.infer_and_assign_layer_names(model)
    (warning,) = warnings_in(capsys.readouterr().err)
    assert warning == (
        "config dict: section 'numbers' selects no layer: its selectors {'layer_numbers': [7], 'layer_types': ['fc1']} match "
        "none of the 6 layers of the model (model, model.block, model.block.fc1, model.block.attn, model.fused, "
        "model.fused.gate [gated]); "
        "its features do nothing"
    )
    for layer_name in ("model.block.fc1", "model.block.attn", "model.fused.gate"):
        call(layer_name)
    debug_api.step()
    assert warnings_in(capsys.readouterr().err) == []  # 'numbers' was warned about; 'declared' matched its type


def test_naming_before_initialize_warns_nothing(log_dir, capsys):
    debug_api.infer_and_assign_layer_names(Block())
    assert warnings_in(capsys.readouterr().err) == []
