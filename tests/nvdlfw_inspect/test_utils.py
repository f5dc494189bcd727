"""Helpers of nvdlfw_inspect.utils outside a process group, call-site keys, once-only messages."""

from __future__ import annotations

import torch
from logreader import read_messages

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.utils import (
    APICacheIdentifier,
    SingleMessageLogger,
    append_parent_docstring,
    gather_along_first_dim,
    gather_tensor_on_last_rank,
    get_distributed_rank,
    get_distributed_world_size,
    is_distributed,
)


def test_single_process_distributed_helpers():
    t = torch.arange(6.0).reshape(3, 2)
    assert not is_distributed()
    assert get_distributed_rank() == 0 and get_distributed_world_size() == 1
    gathered, extra = gather_along_first_dim(t)
    assert gathered is t and extra is None
    assert gather_tensor_on_last_rank(t) is t


def _touch():
    APICacheIdentifier.save_call_details()


def test_call_site_identifier_names_the_callers_line():
    _touch()
    here = f"{__file__}.{_line_of('_touch()  # site A')}"
    _touch()  # site A
    assert APICacheIdentifier.get_call_details() == here
    uid = APICacheIdentifier.get_unique_identifier({"api": ["tensor_name", "gemm"]}, "l1", "api", tensor_name="x")
    assert uid == f"{here}.l1.api.x.0"
    assert APICacheIdentifier.get_unique_identifier({}, "l1", "api") is None
    APICacheIdentifier.reset()
    assert APICacheIdentifier.get_call_details() is None


def _line_of(marker: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip().endswith(marker) and "_line_of" not in line)


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
    assert "LAYER=l2: hello" in messages and "LAYER=l1: bye" in messages


def test_append_parent_docstring():
    class Parent:
        """Parent text."""

    @append_parent_docstring(parent=Parent)
    class Child(Parent):
        """Child text."""

    assert Child.__doc__ == "Child text.\n\nParent text."
