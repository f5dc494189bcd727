"""The framework's command line: validate configs, list and explain features, write reports, diagnose runs.

Exit codes: 0 success, 1 a user error (invalid config, missing file or log), 2 a usage error.

The installed ``nvdlfw-inspect`` command is ``lowprec.cli``: this command line with lowprec's features and its
``demo``. A library extends it the same way, passing its ``Command``s to ``main``: the framework never imports
a library, so ``python -m nvdlfw_inspect.cli`` knows only the features of the directories it is given.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.config_manager import check_config, find_config_errors
from nvdlfw_inspect.config_yaml import config_line
from nvdlfw_inspect.diagnose.command import add_arguments as diagnose_arguments
from nvdlfw_inspect.errors import ConfigError, NvdlfwInspectError
from nvdlfw_inspect.explain import ALL, explanation, feature_matches, suggestion
from nvdlfw_inspect.reading import SkippedRecordsWarning, read_routing, run_layers
from nvdlfw_inspect.registry import Registry
from nvdlfw_inspect.section_coverage import base_features_on_routed_layers
from nvdlfw_inspect.section_overlaps import possible_overlaps


class UserError(Exception):
    """A problem with what the user gave the command: reported in one line, exit code 1."""


@dataclass(frozen=True)
class Command:
    """A subcommand: its name, one line of help, a function adding its arguments, and one running it
    (returning the exit code)."""

    name: str
    text: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


@contextlib.contextmanager
def loaded_features(feature_dirs: list[str]) -> Iterator[None]:
    """Every namespace and feature loaded, as ``initialize`` loads them (the built-in ones, those of the
    libraries imported, and ``feature_dirs``), with the logs in a scratch directory."""
    quiet = io.StringIO()  # initialize's notes (no config given, where the logs are) are not for this command
    with tempfile.TemporaryDirectory() as log_dir, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        debug_api.initialize(config_file="", feature_dirs=feature_dirs or None, log_dir=log_dir)
    try:
        yield
    finally:
        debug_api.end_debug()


def config_errors(path: Path, feature_dirs: list[str], layers: Sequence[str] = ()) -> list[ConfigError]:
    """Every error of the config file ``path`` against the loaded features (and, on ``layers``, two sections that
    configure one feature for one of them); nothing is written."""
    return config_check(path, feature_dirs, layers)[0]


def config_check(
    path: Path, feature_dirs: list[str], layers: Sequence[str] = (), routed: Sequence[str] = ()
) -> tuple[list[ConfigError], list[str]]:
    """The errors of ``config_errors`` and the warnings: those of loading, sections that could both configure
    one feature for a layer (``possible_overlaps``), which only a layer both select makes an error, and
    base-namespace features on ``routed`` layers (``base_features_on_routed_layers``)."""
    if not path.is_file():
        raise UserError(f"config file not found: {str(path)!r}")
    with loaded_features(feature_dirs):
        checked = check_config(path, Registry.data, Registry.unusable, layers)
        warned = checked.warnings + possible_overlaps(checked.specs)
        return checked.errors, warned + base_features_on_routed_layers(checked.specs, routed)


def print_config_errors(path: Path, errors: list[ConfigError]) -> None:
    """Each error on stderr as ``file:line: message`` (``file:line:column:`` for YAML syntax) in the order of
    their lines, then the count."""
    located = sorted(((_position(path, error), error) for error in errors), key=lambda item: item[0])
    for (line, column), error in located:
        print(f"{path}:{line}:{f'{column}:' if column else ''} {error}", file=sys.stderr)
    print(f"{path}: {len(errors)} error{'s' if len(errors) > 1 else ''}", file=sys.stderr)


def _position(path: Path, error: ConfigError) -> tuple[int, int]:
    """Where the parser stopped, for a syntax error; else the line of the error's key (column 0: none)."""
    if error.line is not None:
        return error.line, error.column or 0
    return (config_line(path, error.key_path) if error.key_path else None) or 1, 0


def validate(args: argparse.Namespace) -> int:
    """Check the config; with ``--layers-from``, also on the layer names that run logged."""
    path = Path(args.config)
    layers = _run_layers(args.layers_from) if args.layers_from else []
    routed = _routed_layers(args.layers_from) if args.layers_from else []
    errors, warned = config_check(path, args.feature_dirs, layers, routed)
    if errors:
        print_config_errors(path, errors)
        return 1
    for warning in warned:
        print(f"{path}: warning: {warning}", file=sys.stderr)
    checked = f" (and on the {len(layers)} layers logged in {args.layers_from})" if layers else ""
    noted = f", {len(warned)} warning{'s' if len(warned) > 1 else ''}" if warned else ""
    print(f"{path}: valid{checked}{noted}")
    return 0


def _run_layers(log_dir: str) -> list[str]:
    """The layer names the run in ``log_dir`` logged (``reading.run_layers``); none is a user error."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SkippedRecordsWarning)
        try:
            layers = run_layers(log_dir)
        finally:
            _print_warnings("validate", caught)
    if not layers:
        raise UserError(f"no layer names are logged in '{log_dir}'")
    return layers


def _routed_layers(log_dir: str) -> list[str]:
    """The layers of the run in ``log_dir`` whose GEMMs a library routed: those of its routing records that a
    feature or recipe decided (not a module the library left in high precision, which has a ``reason``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedRecordsWarning)  # _run_layers said them
        return sorted({record.layer for record in read_routing(log_dir) if record.reason is None})


def list_features(args: argparse.Namespace) -> int:
    with loaded_features(args.feature_dirs):
        names = _feature_names()
    print("\n".join(names))
    return 0


def explain(args: argparse.Namespace) -> int:
    """Each named feature's documentation as plain text; a bare name in several namespaces explains each."""
    with loaded_features(args.feature_dirs):
        features = {f"{ns}.{name}": feature for ns, data in Registry.data.items() for name, feature in data.features.items()}
    explained = []
    for name in args.features:
        matches = feature_matches(name, features)
        if not matches:
            hint = suggestion(name, features)
            raise UserError(
                f"unknown feature {name!r}; known: {', '.join(features)}" + (f"; did you mean {hint!r}?" if hint else "")
            )
        if len(matches) > 1 and name != ALL:
            explained.append(f"{name} is in {len(matches)} namespaces: {', '.join(matches)} (give namespace.{name} for one)")
        explained += [explanation(match, features[match].__doc__) for match in matches]
    print("\n\n".join(explained))
    return 0


def _feature_names() -> list[str]:
    """The loaded features as ``namespace.Feature`` (``list_features`` also prints them: not here)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return debug_api.list_features()


def report(args: argparse.Namespace) -> int:
    """Write the report; warnings of the reading (records skipped) are printed as the command's own."""
    from nvdlfw_inspect.report import write_report

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SkippedRecordsWarning)
        try:
            path = write_report(args.log_dir, args.output)
        except (FileNotFoundError, ValueError) as error:
            raise UserError(str(error)) from None
        finally:
            _print_warnings("report", caught)
    print(f"report: {path}")
    return 0


def diagnose(args: argparse.Namespace) -> int:
    """Print what is wrong with a run and write the config of remedies (``nvdlfw_inspect.diagnose``); with
    ``--config``, the user's config is checked as ``validate`` does, and so is the merged config written."""
    from nvdlfw_inspect.diagnose import command

    if args.config is not None:
        path = Path(args.config)
        errors = config_errors(path, args.feature_dirs)
        if errors:
            print_config_errors(path, errors)
            return 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SkippedRecordsWarning)
        try:
            with loaded_features(args.feature_dirs) if args.config is not None else contextlib.nullcontext():
                code = command.run(
                    args, sys.stdout, lambda config, layers: find_config_errors(config, Registry.data, Registry.unusable, layers)
                )
        except ValueError as error:
            raise UserError(str(error)) from None
        finally:
            _print_warnings("diagnose", caught)
    return code


def _diagnose_arguments(sub: argparse.ArgumentParser) -> None:
    diagnose_arguments(sub)
    _feature_dirs_argument(sub)


def _print_warnings(command: str, caught: list[warnings.WarningMessage]) -> None:
    """The reading's warnings (records skipped) as the command's own, printed even when the command fails."""
    for warning in caught:
        print(f"nvdlfw-inspect {command}: warning: {warning.message}", file=sys.stderr)


def _feature_dirs_argument(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--feature-dirs", nargs="*", default=[], metavar="DIR", help="extra directories of features")


def _validate_arguments(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("config", help="the YAML config file")
    sub.add_argument(
        "--layers-from",
        metavar="LOG_DIR",
        help="also check, on the layer names the run in LOG_DIR logged, that no two sections configure one feature for one layer",
    )
    _feature_dirs_argument(sub)


def _explain_arguments(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("features", nargs="+", metavar="FEATURE", help="namespace.Feature, Feature, or all")
    _feature_dirs_argument(sub)


def _report_arguments(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("log_dir", help="the log_dir given to debug_api.initialize (or its statistics directory)")
    sub.add_argument("-o", "--output", help="the HTML file (default: LOG_DIR/report.html)")


COMMANDS = (
    Command(
        "validate", "Check a YAML config; print every error with its file, line and key path.", _validate_arguments, validate
    ),
    Command("list-features", "List every loaded feature as namespace.Feature.", _feature_dirs_argument, list_features),
    Command("explain", "Print features' documentation (namespace.Feature, Feature, or all).", _explain_arguments, explain),
    Command("report", "Write the HTML report of the statistics in a log directory.", _report_arguments, report),
    Command(
        "diagnose",
        "Say per layer and tensor what is wrong with a run; write a config that fixes it.",
        _diagnose_arguments,
        diagnose,
    ),
)


def parser(extra: Sequence[Command] = (), description: str | None = None) -> argparse.ArgumentParser:
    """The command line of ``COMMANDS`` and the ``extra`` commands a library adds (with its ``description``)."""
    lines = __doc__.splitlines()
    top = argparse.ArgumentParser(prog="nvdlfw-inspect", description=description or lines[0], epilog=lines[2])
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (*COMMANDS, *extra):
        sub = commands.add_parser(command.name, help=command.text, description=command.text)
        command.arguments(sub)
        sub.set_defaults(run=command.run)
    return top


def main(argv: Sequence[str] | None = None, extra: Sequence[Command] = (), description: str | None = None) -> int:
    """Run the command line, with the ``extra`` commands of a library (``lowprec.cli.main`` passes ``demo``)."""
    args = parser(extra, description).parse_args(argv)
    try:
        return args.run(args)
    except (UserError, NvdlfwInspectError, FileNotFoundError) as error:
        print(f"nvdlfw-inspect {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
