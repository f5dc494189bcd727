"""The run-state owner: API lookup, feature index, step hooks."""

from __future__ import annotations

from functools import partial

import pytest

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.debug_features.log_tensor_stats import LogTensorStats
from nvdlfw_inspect.errors import UnknownAPIError


def test_extension_api_lookup(log_dir):
    debug_api.initialize(log_dir=log_dir)
    manager = debug_api.DEBUG_MANAGER
    router = manager.get_extension_api("log_tensor_stats")
    assert isinstance(router, partial) and router.keywords == {"api_name": "log_tensor_stats"}
    assert manager.get_extension_api("base") is manager._namespace_apis["base"]
    with pytest.raises(UnknownAPIError, match=r"no namespace or base API named 'bsae'.*did you mean 'base'"):
        manager.get_extension_api("bsae")


def test_feature_index_holds_instances_of_the_importable_classes(log_dir):
    debug_api.initialize(log_dir=log_dir)
    manager = debug_api.DEBUG_MANAGER
    assert list(manager._features_explainer) == ["base.LogTensorStats"]
    # the built-in package is imported, not executed from a copy: same class object as a normal import
    assert type(manager._features_explainer["base.LogTensorStats"]) is LogTensorStats
    assert manager._namespace_features_api_map["base"]["log_tensor_stats"] == ["LogTensorStats"]


def test_step_advances_before_namespace_hooks(log_dir):
    debug_api.initialize(log_dir=log_dir, init_training_step=2)
    seen = []
    base_api = debug_api.DEBUG_MANAGER._namespace_apis["base"]
    base_api.step = lambda: seen.append(debug_api.DEBUG_MANAGER._trainer_iteration_count)
    debug_api.step()
    debug_api.step()
    assert seen == [3, 4]
