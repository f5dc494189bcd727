"""Helpers of nvdlfw_inspect.utils: the distributed names it exports, call-site keys, once-only messages, docstrings."""

from __future__ import annotations

import logging

import pytest
import torch
from logreader import read_messages

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect import distributed, utils
from nvdlfw_inspect.debug_features.generic_feature_api import GenericConfigAPIMapper
from nvdlfw_inspect.debug_features.log_tensor_stats import LogTensorStats
from nvdlfw_inspect.utils import APICacheIdentifier, SingleMessageLogger, append_parent_docstring


def _line_of(marker: str) -> int:
    """Line number of the one line in this file that ends with ``marker``."""
    lines = open(__file__).read().splitlines()
    found = [i for i, line in enumerate(lines, 1) if line.rstrip().endswith(marker) and "_line_of" not in line]
    assert len(found) == 1, found
    return found[0]


# --- the distributed helpers, exported as the reference's utils exported them ----------------


@pytest.mark.parametrize(
    "name",
    [
        "is_distributed",
        "get_distributed_rank",
        "get_distributed_world_size",
        "gather_along_first_dim",
        "gather_tensor_on_last_rank",
    ],
)
def test_utils_exports_the_distributed_helpers(name):
    assert getattr(utils, name) is getattr(distributed, name)
    assert name in utils.__all__


# --- APICacheIdentifier -------------------------------------------------------------------


def _touch():
    APICacheIdentifier.save_call_details()


def _touch_deeper():
    APICacheIdentifier.save_call_details(depth=3)


def test_call_site_identifier_names_the_callers_line():
    _touch()  # site A
    here = f"{__file__}.{_line_of('_touch()  # site A')}"
    assert APICacheIdentifier.get_call_details() == here
    uid = APICacheIdentifier.get_unique_identifier({"api": ["tensor_name", "gemm"]}, "l1", "api", tensor_name="x")
    assert uid == f"{here}.l1.api.x.0"  # a missing cacheable kwarg counts as 0
    assert APICacheIdentifier.get_unique_identifier({"api": []}, "l1", "api") == f"{here}.l1.api"
    assert APICacheIdentifier.get_unique_identifier({"api": ["gemm"]}, None, "api", gemm="fprop") == f"{here}.None.api.fprop"
    assert APICacheIdentifier.get_unique_identifier({}, "l1", "api") is None  # not cacheable
    assert APICacheIdentifier.get_unique_identifier({"other": []}, "l1", "api") is None
    APICacheIdentifier.reset()
    assert APICacheIdentifier.get_call_details() is None


def _outer():
    _touch_deeper()


def test_call_site_depth_walks_up_the_stack():
    """depth counts frames above save_call_details: 2 is the caller's caller, 3 one more level up."""
    _outer()  # site B
    assert APICacheIdentifier.get_call_details() == f"{__file__}.{_line_of('_outer()  # site B')}"


def test_distinct_sites_layers_and_kwargs_give_distinct_keys():
    cacheable = {"api": ["tensor_name"]}
    keys = set()
    for _ in range(2):  # the same site twice: same keys
        _touch()  # site C
        keys.add(APICacheIdentifier.get_unique_identifier(cacheable, "l1", "api", tensor_name="a"))
        keys.add(APICacheIdentifier.get_unique_identifier(cacheable, "l2", "api", tensor_name="a"))
        keys.add(APICacheIdentifier.get_unique_identifier(cacheable, "l1", "api", tensor_name="b"))
    _touch()  # site D
    keys.add(APICacheIdentifier.get_unique_identifier(cacheable, "l1", "api", tensor_name="a"))
    assert len(keys) == 4


def test_debug_api_attribute_access_records_the_user_line(log_dir):
    cfg = {
        "s": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": ".*"},
            "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["mean"]},
        }
    }
    debug_api.initialize(config_file=cfg, log_dir=log_dir)
    debug_api.log_tensor_stats(layer_name="l1", tensor=torch.ones(2), tensor_name="activation")  # site E
    assert APICacheIdentifier.get_call_details() == f"{__file__}.{_line_of('# site E')}"
    debug_api.end_debug()
    assert APICacheIdentifier.get_call_details() is None


# --- SingleMessageLogger ------------------------------------------------------------------


def test_single_message_logger_deduplicates_by_site_layer_key_and_text(log_dir):
    debug_api.initialize(config_file="", log_dir=log_dir)
    results = []
    for _ in range(3):
        results.append(SingleMessageLogger.log_message_once("hello", "l1"))
        results.append(SingleMessageLogger.log_message_once("hello", "l2"))
        results.append(SingleMessageLogger.log_message_once("hello", "l1", extra_cachable_args="x"))
        results.append(SingleMessageLogger.log_message_once("bye", "l1"))
    assert results == [True] * 4 + [False] * 8
    SingleMessageLogger.reset()
    assert SingleMessageLogger.log_message_once("hello", "l1")
    debug_api.end_debug()
    messages = [m for _, m in read_messages(log_dir)]
    assert messages.count("LAYER=l1: hello") == 3  # plain, with the extra key, and again after reset
    assert messages.count("LAYER=l2: hello") == 1 and messages.count("LAYER=l1: bye") == 1


def test_single_message_logger_keys_on_the_calling_line(log_dir):
    debug_api.initialize(config_file="", log_dir=log_dir)
    first = [SingleMessageLogger.log_message_once("same text") for _ in range(3)]
    second = SingleMessageLogger.log_message_once("same text")  # another line: written again
    explicit = [SingleMessageLogger.log_message_once("same text", call_site="site") for _ in range(2)]
    assert first == [True, False, False] and second is True and explicit == [True, False]
    debug_api.end_debug()
    assert [m for _, m in read_messages(log_dir)].count("same text") == 3  # no layer: no prefix


def test_single_message_logger_level_and_layer_prefix(log_dir):
    debug_api.initialize(config_file="", log_dir=log_dir)
    SingleMessageLogger.log_message_once("careful", "model.fc1", level=logging.WARNING)
    SingleMessageLogger.log_message_once("plain", "")
    debug_api.end_debug()
    found = read_messages(log_dir)
    assert ("WARNING", "LAYER=model.fc1: careful") in found
    assert ("INFO", "plain") in found


def test_single_message_logger_before_initialize_raises_and_does_not_count(log_dir):
    with pytest.raises(RuntimeError, match="not initialized"):
        SingleMessageLogger.log_message_once("early", call_site="site")
    debug_api.initialize(config_file="", log_dir=log_dir)
    assert SingleMessageLogger.log_message_once("early", call_site="site")  # not swallowed by the failed attempt
    debug_api.end_debug()
    assert ("INFO", "early") in read_messages(log_dir)


def test_end_debug_resets_the_once_only_messages(log_dir, monkeypatch):
    monkeypatch.setenv("NVDLFW_INSPECT_ENABLE_LOG_OVERWRITE", "0")
    for _ in range(2):
        debug_api.initialize(config_file="", log_dir=log_dir)
        assert SingleMessageLogger.log_message_once("per run", call_site="site")
        assert not SingleMessageLogger.log_message_once("per run", call_site="site")
        debug_api.end_debug()
        assert SingleMessageLogger.logged_messages == set()
    assert [m for _, m in read_messages(log_dir)].count("per run") == 2


# --- append_parent_docstring --------------------------------------------------------------


def test_append_parent_docstring():
    class Parent:
        """Parent text."""

    @append_parent_docstring(parent=Parent)
    class Child(Parent):
        """Child text."""

    assert Child.__doc__ == "Child text.\n\nParent text."
    assert Parent.__doc__ == "Parent text."


def test_append_parent_docstring_returns_the_same_class_and_handles_missing_docs():
    class Parent:
        """Parent text."""

    class Undocumented:
        pass

    class Child:
        def method(self):
            return 1

    decorated = append_parent_docstring(parent=Parent)(Child)
    assert decorated is Child and Child().method() == 1
    assert Child.__doc__.strip() == "Parent text."

    @append_parent_docstring(parent=Undocumented)
    class Other:
        """Own text."""

    assert Other.__doc__.strip() == "Own text."


def test_log_tensor_stats_docstring_includes_the_tensor_selection_docs():
    assert LogTensorStats.__doc__.startswith("Logs statistics of the tensors passed")
    assert LogTensorStats.__doc__.endswith(GenericConfigAPIMapper.__doc__)
