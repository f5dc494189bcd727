"""Feature documentation: the names ``explain_features`` takes (qualified, bare, ``all``) and docstrings
rendered as plain text."""

from __future__ import annotations

import textwrap

import pytest

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.explain import feature_matches, plain_text

KNOWN = ["base.LogTensorStats", "probe.LogTensorStats", "probe.Other"]


@pytest.mark.parametrize(
    ("name", "matches"),
    [
        ("probe.Other", ["probe.Other"]),
        ("Other", ["probe.Other"]),
        ("LogTensorStats", ["base.LogTensorStats", "probe.LogTensorStats"]),
        ("all", KNOWN),
        ("Nope", []),
        ("base.Other", []),
    ],
)
def test_feature_matches(name, matches):
    assert feature_matches(name, KNOWN) == matches


class Parent:
    """Shared selection:

    tensors_struct:
      - tensor: activation
    """


class Child:
    """Logs ``stats`` of :class:`Tensor` objects, **always**.

    Keys
    ====
    ``freq``: every `freq` steps.
    """


def test_plain_text_drops_markup_and_indentation_of_appended_docstrings():
    doc = f"{Child.__doc__}\n\n{Parent.__doc__}"  # as append_parent_docstring joins them
    assert plain_text(doc) == textwrap.dedent(
        """\
        Logs stats of Tensor objects, always.

        Keys
        freq: every freq steps.

        Shared selection:

        tensors_struct:
          - tensor: activation"""
    )
    assert plain_text(None) == plain_text("  ") == "(no documentation)"


def test_explain_features_takes_bare_names_and_prints_plain_text(log_dir, capsys):
    debug_api.initialize("", log_dir=log_dir)
    capsys.readouterr()
    debug_api.explain_features("LogTensorStats")
    out = capsys.readouterr().out
    assert out.startswith(
        "----- \nfeature: base.LogTensorStats \nLogs statistics of the tensors passed to debug_api.log_tensor_stats."
    )
    assert "`" not in out and "is not supported" not in out
    debug_api.explain_features(["LogTensorStat"])
    out = capsys.readouterr().out
    assert "feature: LogTensorStat is not supported in this tool." in out and "Did you mean 'LogTensorStats'?" in out
