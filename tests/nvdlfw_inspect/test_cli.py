"""The framework's command line (``nvdlfw_inspect.cli``): every subcommand on the base namespace, its output
and exit codes, and that it never imports ``lowprec``. The installed command, with lowprec's features and
the demo, is tested in ``tests/lowprec/test_installed_command.py``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import nvdlfw_inspect
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.cli import main
from nvdlfw_inspect.logging import MAIN_LOG_DIR, STATISTICS_LOG_DIR, STATISTICS_RECORDS_DIR

STATS_SECTION = "  LogTensorStats: {enabled: True, tensors: [activation], stats: [max]}\n"


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


def test_validate_accepts_a_valid_config(tmp_path, capsys):
    config = write(tmp_path / "ok.yaml", "a:\n  enabled: True\n  layers: {layer_types: [fc1]}\n" + STATS_SECTION)
    assert main(["validate", str(config)]) == 0
    assert capsys.readouterr().out.strip() == f"{config}: valid"


def test_validate_reports_every_independent_error_in_one_run(tmp_path, capsys):
    config = write(
        tmp_path / "bad.yaml",
        """\
        first:
          enabled: yes please
          layers: {layer_type: [fc1], layer_numbers: [-1]}
          LogTensorStats:
            enabled: True
            tensors: [activation]
            stats: [maximum, minimum]
            freq: 0
            start_step: -2
            per_tensor: True
        second:
          enabled: True
          layers: {layer_name_regex_pattern: "("}
          LogTensorStat: {enabled: True}
        """,
    )
    assert main(["validate", str(config)]) == 1
    err = capsys.readouterr().err.splitlines()
    expected = [  # (line, key path, what the message says), in file order
        (2, "first.enabled", "must be a boolean"),
        (3, "first.layers.layer_type", "unknown layer selector"),
        (3, "first.layers.layer_numbers", "layer numbers cannot be negative"),
        (7, "first.LogTensorStats.stats.0", "did you mean 'max'?"),
        (7, "first.LogTensorStats.stats.1", "did you mean 'min'?"),
        (8, "first.LogTensorStats.freq", "must be a positive integer"),
        (9, "first.LogTensorStats.start_step", "must be a non-negative integer"),
        (10, "first.LogTensorStats.per_tensor", "unknown key"),
        (13, "second.layers.layer_name_regex_pattern", "invalid regular expression"),
        (14, "second.LogTensorStat", "did you mean 'LogTensorStats'?"),
    ]
    assert len(err) == len(expected) + 1 and err[-1] == f"{config}: {len(expected)} errors"
    for line, (number, key_path, what) in zip(err, expected, strict=False):
        assert line.startswith(f"{config}:{number}: ") and f"key '{key_path}'" in line and what in line, line


def test_an_unknown_key_with_a_block_value_is_reported_on_the_keys_line(tmp_path, capsys):
    """A block value starts on the line after its key: the error names the key's line (issue 26: line 7 for 6)."""
    config = write(
        tmp_path / "bad.yaml",
        """\
        first:
          enabled: True
          layers:
            layer_types: [fc1]
          LogTensorStats:
            per_tensor:
              - activation
            enabled: True
            tensors: [activation]
            stats: [max]
          LogTensorStat:
            enabled: True
        """,
    )
    assert main(["validate", str(config)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"{config}:6: ") and "key 'first.LogTensorStats.per_tensor': unknown key" in err[0], err
    assert err[1].startswith(f"{config}:11: ") and "key 'first.LogTensorStat'" in err[1], err
    assert err[2:] == [f"{config}: 2 errors"]


def test_yaml_syntax_errors_name_the_parsers_line_and_column(tmp_path, capsys):
    config = write(tmp_path / "broken.yaml", "a:\n  enabled: True\n  layers: {layer_types: [fc1]\n  LogTensorStats: {}\n")
    assert main(["validate", str(config)]) == 1
    err = capsys.readouterr().err  # the parser's own message says where it stopped: line 4, column 3
    assert err.startswith(f"{config}:4:3: config file '{config}': not valid YAML: while parsing a flow mapping")
    assert 'in "' in err and "line 4, column 3" in err and err.endswith(f"{config}: 1 error\n")


def test_validate_user_errors(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 1
    assert "config file not found" in capsys.readouterr().err


@pytest.fixture
def probe_namespace(tmp_path):
    """A feature directory with a second namespace that also has a LogTensorStats."""
    directory = tmp_path / "probe_features"
    directory.mkdir()
    write(
        directory / "probe.py",
        '''\
        from nvdlfw_inspect.debug_features.generic_feature_api import GenericFrameworkAPI
        from nvdlfw_inspect.registry import Registry


        @Registry.register_namespace_api(namespace="probe")
        class ProbeAPI(GenericFrameworkAPI):
            """Routes the probe namespace."""


        @Registry.register_feature(namespace="probe")
        class LogTensorStats:
            """The probe's ``LogTensorStats``: see :class:`Other`.

            Usage
            -----
            Nothing to ``configure``.
            """
        ''',
    )
    return directory


def test_explain_renders_plain_text(capsys):
    assert main(["explain", "base.LogTensorStats"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("base.LogTensorStats\n  Logs statistics of the tensors passed to debug_api.log_tensor_stats.\n")
    assert "`" not in out and "-----" not in out and "*****" not in out
    assert "\n  tensors_struct:" in out and "\n    - tensor: activation" in out  # the example keeps its shape


def test_explain_an_ambiguous_name_explains_each(probe_namespace, capsys):
    assert main(["explain", "LogTensorStats", "--feature-dirs", str(probe_namespace)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("LogTensorStats is in 2 namespaces: base.LogTensorStats, probe.LogTensorStats")
    assert "\nbase.LogTensorStats\n" in out and "\nprobe.LogTensorStats\n" in out
    assert "The probe's LogTensorStats: see Other." in out and "Usage\n  Nothing to configure." in out
    assert main(["explain", "probe.LogTensorStats", "--feature-dirs", str(probe_namespace)]) == 0
    assert capsys.readouterr().out.startswith("probe.LogTensorStats\n")


def test_explain_all_and_unknown_names(probe_namespace, capsys):
    assert main(["explain", "all", "--feature-dirs", str(probe_namespace)]) == 0
    out = capsys.readouterr().out
    assert "\nbase.LogTensorStats\n" in f"\n{out}" and "\nprobe.LogTensorStats\n" in out and "namespaces:" not in out
    assert main(["explain", "LogTensorStat"]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == "nvdlfw-inspect explain: unknown feature 'LogTensorStat'; known: base.LogTensorStats; did you mean 'LogTensorStats'?\n"
    )


def test_list_features(capsys):
    assert main(["list-features"]) == 0
    assert capsys.readouterr().out.split() == ["base.LogTensorStats"]


def test_usage_errors_exit_2():
    for argv in ([], ["frobnicate"], ["validate"], ["explain"], ["demo"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2


@pytest.fixture
def run_dir(tmp_path):
    """A finished run of two steps with base-namespace statistics."""
    log_dir = tmp_path / "run"
    debug_api.initialize(
        {
            "s": {
                "enabled": True,
                "layers": {"layer_name_regex_pattern": ".*"},
                "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max", "min"]},
            }
        },
        log_dir=str(log_dir),
    )
    for _ in range(2):
        debug_api.log_tensor_stats("model.fc", tensor=torch.randn(8, 8), tensor_name="activation")
        debug_api.step()
    debug_api.end_debug()
    return log_dir


@pytest.mark.parametrize("subdirectory", [STATISTICS_LOG_DIR, STATISTICS_RECORDS_DIR, MAIN_LOG_DIR])
def test_report_diagnose_and_read_stats_take_a_directory_of_the_run(run_dir, subdirectory, capsys):
    given = run_dir / subdirectory
    assert main(["report", str(given)]) == 0
    assert capsys.readouterr().out == f"report: {run_dir / 'report.html'}\n"
    assert main(["diagnose", str(given)]) == 0
    assert capsys.readouterr().out.startswith(f"No findings in {run_dir} ")
    assert nvdlfw_inspect.read_stats(given).equals(nvdlfw_inspect.read_stats(run_dir))


def test_report_without_statistics(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 1
    assert "no statistics in" in capsys.readouterr().err


def test_the_framework_command_line_never_imports_lowprec(tmp_path, run_dir):
    config = write(tmp_path / "ok.yaml", "a:\n  enabled: True\n  layers: {layer_types: [fc1]}\n" + STATS_SECTION)
    script = f"""
import sys
import nvdlfw_inspect.cli as cli
for argv in (["validate", {str(config)!r}], ["list-features"], ["explain", "all"], ["report", {str(run_dir)!r}], ["--help"]):
    try:
        assert cli.main(argv) == 0, argv
    except SystemExit as end:
        assert end.code == 0, argv
imported = sorted(name for name in sys.modules if name == "lowprec" or name.startswith("lowprec."))
assert not imported, imported
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "demo" not in result.stdout.split("COMMAND")[1]  # the framework's --help lists no demo: lowprec's command adds it
