"""The base namespace router and the tensor-selection grammar its features share."""

from __future__ import annotations

import pytest

from nvdlfw_inspect.debug_features.generic_feature_api import (
    GenericConfigAPIMapper,
    GenericFrameworkAPI,
    check_keys,
    tensor_views,
)
from nvdlfw_inspect.errors import ConfigError, ConfigLocation

LOC = ConfigLocation("config file 'c.yaml'", ("sec", "LogTensorStats"))


def test_parse_config_resolves_one_tensor_and_drops_enabled():
    mapper = GenericConfigAPIMapper()
    raw = {"enabled": True, "stats": ["min"], "tensors_struct": [{"tensor": "weight", "freq": 5}]}
    assert mapper.parse_config_and_api(raw, tensor_parsing=True, tensor_name="weight") == (
        True,
        {"stats": ["min"], "tensor": "weight", "freq": 5},
    )
    assert raw["tensors_struct"] == [{"tensor": "weight", "freq": 5}]  # the raw config is not mutated
    assert mapper.parse_config_and_api(raw, tensor_parsing=True, tensor_name="activation") == (False, None)
    assert mapper.parse_config_and_api(raw, tensor_name="weight") == (False, None)  # no tensor parsing asked


def test_tensor_views_give_each_tensor_its_merged_options():
    views = tensor_views({"stats": ["min"], "freq": 2, "tensors_struct": [{"tensor": "a"}, {"tensor": "b", "freq": 3}]}, LOC)
    assert [v for v, _ in views] == [{"stats": ["min"], "freq": 2, "tensor": "a"}, {"stats": ["min"], "freq": 3, "tensor": "b"}]
    # keys an item defines are reported at the item, inherited ones at the feature
    assert views[1][1].child("freq").key_path == "sec.LogTensorStats.tensors_struct.1.freq"
    assert views[1][1].child("stats").key_path == "sec.LogTensorStats.stats"
    assert tensor_views({"tensors": "a"}, LOC)[0][0] == {"tensors": "a"}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({}, r"key 'sec\.LogTensorStats': needs 'tensors: \[names\]' or 'tensors_struct"),
        ({"tensors": []}, r"key 'sec\.LogTensorStats\.tensors': must be a non-empty list of tensor names; got \[\]"),
        ({"tensors": [1]}, r"tensors': must be a non-empty list of tensor names; got \[1\]"),
        ({"tensors_struct": {"tensor": "a"}}, r"tensors_struct': must be a non-empty list of mappings"),
        ({"tensors_struct": [{"stats": ["min"]}]}, r"tensors_struct\.0': each item must be a mapping with a string 'tensor' key"),
        ({"tensors": ["a"], "tensors_struct": [{"tensor": "a"}]}, r"either 'tensors' or 'tensors_struct', not both"),
        ({"tensors_struct": [{"tensor": "a"}, {"tensor": "a"}]}, r"tensors_struct\.1\.tensor'.*already has an item.*'a'"),
    ],
)
def test_tensor_grammar_errors(config, message):
    with pytest.raises(ConfigError, match=message):
        tensor_views(config, LOC)


def test_check_keys_names_the_key_and_the_allowed_set():
    with pytest.raises(
        ConfigError, match=r"key 'sec\.LogTensorStats\.tensor': unknown key; got 'tensor'.*did you mean 'tensors'"
    ):
        check_keys({"tensor": ["a"]}, frozenset({"tensors", "stats"}), LOC)
    check_keys({"anything": 1}, None, LOC)


def test_base_router_hooks():
    api = GenericFrameworkAPI()
    with pytest.raises(TypeError, match="needs the keyword argument 'tensor'"):
        api.input_assertions_hook("log_tensor_stats", tensor_name="x")
    api.input_assertions_hook("other_api")
    assert api.is_multiple_feature_invocation_allowed("log_tensor_stats") is False
    assert api._cacheable_api_kwargs_map == {"log_tensor_stats": ["tensor_name"]}
