"""Exception classes and ConfigLocation, the formatter behind every config error message."""

from __future__ import annotations

import pytest

from nvdlfw_inspect.errors import (
    AlreadyInitializedError,
    ConfigError,
    ConfigLocation,
    FeatureLoadError,
    NotInitializedError,
    NvdlfwInspectError,
    RegistryError,
    UnknownAPIError,
    closest,
    is_int,
    is_number,
)


@pytest.mark.parametrize(
    ("cls", "builtin_bases"),
    [
        (ConfigError, (ValueError,)),
        (FeatureLoadError, (ImportError,)),
        (RegistryError, (TypeError,)),
        (NotInitializedError, (RuntimeError, AttributeError)),
        (UnknownAPIError, (AttributeError, ValueError)),
        (AlreadyInitializedError, (RuntimeError, ValueError)),
    ],
)
def test_errors_are_framework_errors_and_the_matching_builtin(cls, builtin_bases):
    error = cls("boom")
    assert isinstance(error, NvdlfwInspectError)
    for base in builtin_bases:
        assert isinstance(error, base)
    assert not isinstance(error, AssertionError)
    assert str(error) == "boom"


def test_not_initialized_error_makes_hasattr_false():
    class Lazy:
        def __getattr__(self, name):
            raise NotInitializedError("not initialized")

    assert hasattr(Lazy(), "anything") is False


@pytest.mark.parametrize(
    ("name", "candidates", "expected"),
    [
        ("LogTensorStat", ["LogTensorStats", "base"], "LogTensorStats"),
        ("layer_number", ["layer_numbers", "layer_types", "exact_layer_names"], "layer_numbers"),
        ("meen", ["min", "max", "mean", "std"], "mean"),
        ("completely_different", ["min", "max"], None),
        ("x", [], None),
    ],
)
def test_closest(name, candidates, expected):
    assert closest(name, candidates) == expected


def test_closest_accepts_non_string_candidates():
    assert closest("5", [5, "x"]) == "5"


def test_location_key_path_and_child():
    top = ConfigLocation("config file 'a.yaml'")
    assert top.key_path == "<top level>"
    nested = top.child("sec").child("LogTensorStats").child("stats").child(2)
    assert nested.key_path == "sec.LogTensorStats.stats.2"
    assert nested.source == "config file 'a.yaml'"
    assert nested.path == ("sec", "LogTensorStats", "stats", "2")
    # child() builds a new location and leaves the parent alone
    assert top.path == ()


def test_error_is_built_not_raised_and_names_everything():
    location = ConfigLocation("config dict").child("sec").child("layers").child("layer_numbers")
    error = location.error("invalid layer number", "abc", "a non-negative int or 'A-B'")
    assert type(error) is ConfigError
    assert str(error) == (
        "config dict: key 'sec.layers.layer_numbers': invalid layer number; got 'abc'; allowed: a non-negative int or 'A-B'"
    )


def test_error_with_allowed_list_gives_did_you_mean_for_strings():
    error = ConfigLocation("src").child("s").error("unknown layer selector", "layer_number", ["layer_numbers", "layer_types"])
    assert str(error) == (
        "src: key 's': unknown layer selector; got 'layer_number'; allowed: 'layer_numbers', 'layer_types'; "
        "did you mean 'layer_numbers'?"
    )


def test_error_without_close_match_has_no_hint():
    message = str(ConfigLocation("src").error("unknown", "zzzzzz", ["alpha", "beta"]))
    assert "did you mean" not in message
    assert "allowed: 'alpha', 'beta'" in message


def test_error_for_non_string_value_has_no_hint_and_uses_repr():
    message = str(ConfigLocation("src").child("k").error("must be a boolean", 1, [True, False]))
    assert message == "src: key 'k': must be a boolean; got 1; allowed: True, False"


def test_error_without_value_or_allowed():
    assert str(ConfigLocation("src").child("sec").error("missing required key 'enabled'")) == (
        "src: key 'sec': missing required key 'enabled'"
    )


def test_error_shows_none_value():
    # None is a real (bad) value and must be shown, unlike "no value given"
    assert "got None" in str(ConfigLocation("src").error("must be a mapping", None))


def test_error_accepts_generator_of_allowed_values():
    message = str(ConfigLocation("src").error("bad", "mena", (s for s in ["mean", "max"])))
    assert "allowed: 'mean', 'max'" in message
    assert "did you mean 'mean'?" in message


@pytest.mark.parametrize(
    "value, integer, number",
    [(3, True, True), (-1, True, True), (2.5, False, True), (True, False, False), (False, False, False), ("3", False, False)],
)
def test_bool_is_neither_an_int_nor_a_number(value, integer, number):
    assert is_int(value) is integer and is_number(value) is number
