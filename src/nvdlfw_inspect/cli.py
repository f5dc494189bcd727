"""The nvdlfw-inspect command: validate configs, list and explain features, write reports, diagnose runs, run the demo.

Exit codes: 0 success, 1 a user error (invalid config, missing file or log), 2 a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.config_manager import config_line, find_config_errors
from nvdlfw_inspect.diagnose.command import add_arguments as diagnose_arguments
from nvdlfw_inspect.errors import NvdlfwInspectError
from nvdlfw_inspect.reading import TornLineWarning
from nvdlfw_inspect.registry import Registry


class UserError(Exception):
    """A problem with what the user gave the command: reported in one line, exit code 1."""


@contextlib.contextmanager
def loaded_features(feature_dirs: list[str]) -> Iterator[None]:
    """Every namespace and feature loaded, as ``initialize`` loads them, with the logs in a scratch
    directory. ``lowprec`` is imported when installed, so its ``transformer_engine`` features are there."""
    dirs = list(feature_dirs)
    with contextlib.suppress(ImportError):
        dirs.append(importlib.import_module("lowprec").FEATURE_DIR)
    quiet = io.StringIO()  # initialize's notes (no config given, where the logs are) are not for this command
    with tempfile.TemporaryDirectory() as log_dir, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        debug_api.initialize(config_file="", feature_dirs=dirs or None, log_dir=log_dir)
    try:
        yield
    finally:
        debug_api.end_debug()


def validate(args: argparse.Namespace) -> int:
    path = Path(args.config)
    if not path.is_file():
        raise UserError(f"config file not found: {str(path)!r}")
    with loaded_features(args.feature_dirs):
        errors = find_config_errors(path, Registry.data)
    for error in errors:
        line = config_line(path, error.key_path) if error.key_path else None
        print(f"{path}:{line or 1}: {error}", file=sys.stderr)
    if errors:
        print(f"{path}: {len(errors)} error{'s' if len(errors) > 1 else ''}", file=sys.stderr)
        return 1
    print(f"{path}: valid")
    return 0


def list_features(args: argparse.Namespace) -> int:
    with loaded_features(args.feature_dirs):
        names = _feature_names()
    print("\n".join(names))
    return 0


def explain(args: argparse.Namespace) -> int:
    with loaded_features(args.feature_dirs):
        known = _feature_names()
        if args.feature not in known:
            matches = [name for name in known if name.split(".")[-1] == args.feature]
            if len(matches) != 1:
                raise UserError(f"unknown feature {args.feature!r}; known: {', '.join(known)}")
            args.feature = matches[0]
        debug_api.explain_features(args.feature)
    return 0


def _feature_names() -> list[str]:
    """The loaded features as ``namespace.Feature`` (``list_features`` also prints them: not here)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return debug_api.list_features()


def report(args: argparse.Namespace) -> int:
    """Write the report; warnings of the reading (a torn last line skipped) are printed as the command's own."""
    from nvdlfw_inspect.report import write_report

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TornLineWarning)
        try:
            path = write_report(args.log_dir, args.output)
        except (FileNotFoundError, ValueError) as error:
            raise UserError(str(error)) from None
    for warning in caught:
        print(f"nvdlfw-inspect report: warning: {warning.message}", file=sys.stderr)
    print(f"report: {path}")
    return 0


def diagnose(args: argparse.Namespace) -> int:
    """Print what is wrong with a run and write the config of remedies (``nvdlfw_inspect.diagnose``)."""
    from nvdlfw_inspect.diagnose import command

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TornLineWarning)
        try:
            code = command.run(args, sys.stdout)
        except ValueError as error:
            raise UserError(str(error)) from None
    for warning in caught:
        print(f"nvdlfw-inspect diagnose: warning: {warning.message}", file=sys.stderr)
    return code


def demo(args: argparse.Namespace) -> int:
    from lowprec.demo import run_demo

    run_demo(steps=args.steps, size=args.size, config=args.config, log_dir=args.log_dir, device=args.device)
    return 0


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="nvdlfw-inspect", description=__doc__.splitlines()[0], epilog=__doc__.splitlines()[2])
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run: Callable[[argparse.Namespace], int], text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=text, description=text)
        sub.set_defaults(run=run)
        return sub

    def feature_dirs(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--feature-dirs", nargs="*", default=[], metavar="DIR", help="extra directories of features")

    sub = command("validate", validate, "Check a YAML config; print every error with its file, line and key path.")
    sub.add_argument("config", help="the YAML config file")
    feature_dirs(sub)
    sub = command("list-features", list_features, "List every loaded feature as namespace.Feature.")
    feature_dirs(sub)
    sub = command("explain", explain, "Print a feature's documentation (namespace.Feature or Feature).")
    sub.add_argument("feature")
    feature_dirs(sub)
    sub = command("report", report, "Write the HTML report of the statistics in a log directory.")
    sub.add_argument("log_dir", help="the log_dir given to debug_api.initialize")
    sub.add_argument("-o", "--output", help="the HTML file (default: LOG_DIR/report.html)")
    sub = command("diagnose", diagnose, "Say per layer and tensor what is wrong with a run, and write a config that fixes it.")
    diagnose_arguments(sub)
    sub = command("demo", demo, "Train a small GPT on text shipped with Python in emulated FP8, with statistics and a report.")
    sub.add_argument("--steps", type=positive_int, default=300, help="training steps (default 300)")
    sub.add_argument("--size", choices=["tiny", "small", "base"], default="small", help="model size (default small)")
    sub.add_argument("--config", help="a YAML config instead of the demo's")
    sub.add_argument("--log-dir", default="./demo_logs", help="where logs and the report go (default ./demo_logs)")
    sub.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (UserError, NvdlfwInspectError, FileNotFoundError) as error:
        print(f"nvdlfw-inspect {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
