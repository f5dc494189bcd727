"""``nvdlfw-inspect diagnose LOG_DIR``: its flags (one per threshold, defaults from ``Thresholds``) and
what it prints: the findings as text or JSON, and where it wrote the config of remedies (with ``--config``, the
user's config with the remedies merged in, ``merge``)."""

from __future__ import annotations

import argparse
import json
import math
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from nvdlfw_inspect import invocation
from nvdlfw_inspect.config_manager import read_sections
from nvdlfw_inspect.diagnose import Diagnosis, Thresholds, diagnose
from nvdlfw_inspect.diagnose import config as remedy_config
from nvdlfw_inspect.diagnose.in_format import PLAN_KEY
from nvdlfw_inspect.diagnose.merge import merge
from nvdlfw_inspect.diagnose.thresholds import BLOCK_CHECKS, CALIBRATED_UNDERFLOW_PCT, FORMAT_UNDERFLOW_PCT, RECIPE_FORMATS
from nvdlfw_inspect.errors import ConfigError
from nvdlfw_inspect.files import write_text_atomic
from nvdlfw_inspect.reading import NonfiniteRecord, first_nonfinite_record, read_nonfinite, run_directory

# Every error of a config (a dict) that routing the run's layers (the names given) would meet.
ConfigChecker = Callable[[dict, list[str]], list[ConfigError]]

CONFIG_NAME = "diagnose_config.yaml"
FLAGS = {
    "underflow_pct": (
        float,
        "%% of all values (zeros too) that flush to zero from non-zero (underflows%%) that is a problem in the formats with "
        "FP8 elements (MXFP6, MXFP4 and NVFP4 have calibrated thresholds: --format-underflow-pct)",
    ),
    "overflow_pct": (float, "%% of values saturated under delayed scaling (overflows%%) that is a problem"),
    "persistence": (float, "fraction of the iterations after warm-up a value must be over its threshold"),
    "tail": (float, "last fraction of the run whose median must stay under the threshold"),
    "warmup": (int, "iterations at the start whose values are warm-up transients"),
    "scale_change": (float, "factor a scale (or amax) may change by between logged iterations"),
    "range_margin_bits": (float, "bits a dynamic_range may exceed its FP8 format's range"),
    "peer_ratio": (float, "factor a tensor's magnitude may differ from its peers' (same tensor, layers alike but for indices)"),
    "trend_baseline": (int, "logged iterations after warm-up whose median is a growth's baseline"),
    "trend_steps": (int, "consecutive logged iterations over a growth factor that start a growth"),
    "kurtosis_growth": (float, "factor over its baseline that kurtosis may grow by"),
    "outlier_growth": (float, "factor over its baseline that outlier_channel_ratio may grow by"),
    "scale_drift": (float, "factor over its baseline that a scale (scale_inv_max, else cur_amax) may grow by"),
    "block_underflow_pct": (
        float,
        "%% of a block format's blocks that flush most of their values (underflow_blocks%%) that is a problem, for every "
        "block format",
    ),
    "block_saturation_pct": (
        float,
        "%% of the blocks holding a saturated value (saturated_blocks%%) that is a problem, for every format whose scales "
        "round down (the OCP rule, NVFP4)",
    ),
    "worst_block_err": (
        float,
        "relative error of the worst block (worst_block_rel_err) that is a problem, for every block format",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Thresholds()
    parser.add_argument("log_dir", help="the log_dir given to debug_api.initialize")
    parser.add_argument("-o", "--output", help=f"the config of remedies (default: LOG_DIR/{CONFIG_NAME})")
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    parser.add_argument(
        "--config",
        metavar="YOUR.yaml",
        help="the run's own config: write one config of it with the remedies merged in, to replace it for the re-run",
    )
    for name, (kind, meaning) in FLAGS.items():
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        shown = "each format's calibrated one, see BLOCK_CHECKS in diagnose/thresholds.py" if default is None else default
        parser.add_argument(flag, type=kind, default=default, help=f"{meaning} (default {shown})")
    parser.add_argument(
        "--fp8-format",
        choices=list(RECIPE_FORMATS),
        default=defaults.fp8_format,
        help="the FP8 elements of per-tensor FP8 layers (and of runs whose routing records name no format): HYBRID is "
        "E4M3 forward and E5M2 gradients (default HYBRID)",
    )
    calibrated = ", ".join(f"{label} {pct:g}" for label, pct in FORMAT_UNDERFLOW_PCT.items())
    parser.add_argument(
        "--format-underflow-pct",
        metavar="FORMAT=PCT",
        action="append",
        type=_format_threshold,
        default=[],
        help=f"the underflows%% threshold of one format (repeatable), over its calibrated one ({calibrated}) or over "
        f"--underflow-pct for the others; formats: {', '.join(CALIBRATED_UNDERFLOW_PCT)}",
    )


def _format_threshold(text: str) -> tuple[str, float]:
    """``nvfp4=30`` as ``("nvfp4", 30.0)``; the label and range are checked by ``Thresholds``."""
    label, sep, pct = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return label.strip().lower(), float(pct)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FORMAT=PCT (nvfp4=30), got {text!r}") from None


def run(args: argparse.Namespace, out: TextIO, check: ConfigChecker | None = None) -> int:
    """Diagnose, write the config when there is something to change, print. With ``args.config`` the config
    written is the user's merged with the remedies (``merge``), which ``check`` must find no error in on the run's
    layer names. Bad thresholds raise ValueError, a config that cannot be written ``WriteError`` (a previous config
    there stays whole)."""
    given = dict(getattr(args, "format_underflow_pct", None) or [])
    thresholds = Thresholds(**{name: getattr(args, name) for name in [*FLAGS, "fp8_format"]}, format_underflow_pct=given)
    log_dir = run_directory(args.log_dir)
    diagnosis = diagnose(log_dir, thresholds)
    path, written = None, diagnosis.config_yaml
    if written is not None and args.config:
        written = merged_yaml(Path(args.config), diagnosis, log_dir, check)
    if written is not None:
        path = Path(args.output) if args.output else log_dir / CONFIG_NAME
        write_text_atomic(path, written, "the config")
    guard = first_nonfinite_record(read_nonfinite(log_dir))
    if args.json:
        first = guard._asdict() if guard is not None else None
        out.write(
            json.dumps({**diagnosis.as_dict(), "first_nonfinite": first, "config_file": str(path) if path else None}) + "\n"
        )
    else:
        out.write(text(diagnosis, str(log_dir), path, args.config, guard))
    return 0


def merged_yaml(user_path: Path, diagnosis: Diagnosis, log_dir: Path, check: ConfigChecker | None) -> str:
    """The user's config at ``user_path`` merged with the diagnosis's remedies, as commented YAML; raises
    ``ConfigError`` naming the file when it cannot be read, ValueError when the merge is not valid (``check``)."""
    source, user = read_sections(user_path)
    config, reasons = remedy_config.build(remedy for finding in diagnosis.findings for remedy in finding.remedies)
    merged, notes = merge(user, config, diagnosis.layers, reasons)
    errors = check(merged, diagnosis.layers) if check is not None else []
    if errors:
        listed = "\n".join(f"  {error}" for error in errors)
        raise ValueError(f"the config merged from {source} and the remedies is not valid (please report it):\n{listed}")
    header = remedy_config.MERGED_HEADER.format(user=str(user_path), source=str(log_dir.resolve()))
    return remedy_config.to_yaml(merged, notes, str(log_dir), header)


def text(
    diagnosis: Diagnosis,
    log_dir: str,
    config_path: Path | None,
    user_config: str | None = None,
    guard: NonfiniteRecord | None = None,
) -> str:
    """The findings for a terminal: the run's first non-finite value where ``NonfiniteGuard`` found one (``guard``),
    what is wrong, then each remedy and why."""
    first, last = diagnosis.iterations or (0, 0)
    count = len(diagnosis.findings)
    found = f"{count or 'No'} finding{'s' if count != 1 else ''}"
    lines = [f"{found} in {log_dir} (iterations {first} to {last}; {_thresholds(diagnosis)})"]
    if guard is not None:
        lines.append(f"first non-finite value (NonfiniteGuard): {_guard_record(guard)}")
    if diagnosis.caution:
        lines.append(f"caution: {diagnosis.caution}")
    if diagnosis.unmeasured:
        lines.append(f"not measured: {diagnosis.unmeasured}")
    if diagnosis.skipped:
        lines.append(f"skipped: {diagnosis.skipped}")
    if diagnosis.in_place:
        lines += ["", "Remedies in place:"] + [f"- {entry.message}" for entry in diagnosis.in_place]
    for number, f in enumerate(diagnosis.findings, 1):
        lines += ["", f"{number}. {f.where}  {f.tensor}  {f.kind} ({f.stat}, from iteration {f.first_iteration})"]
        lines.append(f"   {f.message}")
        for remedy in f.remedies:
            target = f" on {' and '.join(remedy.gemms)}" if remedy.gemms else ""
            lines.append(f"   fix: {remedy.feature}{target}: {remedy.reason}")
    lines.append("")
    if config_path is not None and PLAN_KEY in diagnosis.config:
        quoted = shlex.quote(str(config_path))
        lines.append(
            f"plan: {config_path} holds a {PLAN_KEY} (the remedies that change a layer's format): the re-run needs it "
            f"as lowprec.autocast(recipe=..., plan={str(config_path)!r}) or {invocation.command()} demo --plan {quoted}"
        )
    if config_path is None:
        lines.append("config: none written (nothing to change)")
    elif user_config:
        lines.append(f"config: {config_path} (your {user_config} with the remedies merged in: it replaces yours for the re-run)")
    else:
        lines.append(f"config: {config_path}")
        lines.append(
            "  appending it to a config that configures the same features for the same layers fails; "
            f"for one merged config, run: {invocation.command()} diagnose {shlex.quote(log_dir)} --config YOUR.yaml"
        )
    return "\n".join(lines) + "\n"


def _guard_record(record: NonfiniteRecord) -> str:
    if record.layer is None:
        return f"step {record.iteration}, on another rank of the reduction group than rank {record.rank}"
    return (
        f"step {record.iteration}, rank {record.rank}: layer {record.layer}, tensor {record.tensor} of the "
        f"{record.gemm} GEMM, micro-batch {record.micro_batch}"
    )


def _thresholds(diagnosis: Diagnosis) -> str:
    t = diagnosis.thresholds
    parts = [
        f"underflow > {t.underflow_pct:g}%",
        f"overflow > {t.overflow_pct:g}%",
        f"persistence {t.persistence:g}",
        f"tail {t.tail:g}",
        f"warm-up {t.warmup}",
        f"growth over the median of the first {t.trend_baseline} iterations for {t.trend_steps}: kurtosis > "
        f"x{t.kurtosis_growth:g}, outlier channel > x{t.outlier_growth:g}, scale > x{t.scale_drift:g}",
        f"scale change > x{t.scale_change:g}",
        f"peer ratio > x{t.peer_ratio:g}",
        f"range margin {t.range_margin_bits:g} bits" if not math.isclose(t.range_margin_bits, 0) else "",
        t.fp8_format,
        _format_underflows(t),
        _block_thresholds(t),
    ]
    return ", ".join(part for part in parts if part)


def _block_thresholds(t: Thresholds) -> str:
    """The per-block thresholds given for every block format (none: each format's calibrated ones, which each finding
    names)."""
    given = [f"{stat} > {getattr(t, name):g}" for stat, (name, _, _) in BLOCK_CHECKS.items() if getattr(t, name) is not None]
    return "per block " + ", ".join(given) if given else ""


def _format_underflows(t: Thresholds) -> str:
    """The underflow thresholds of the formats that have their own (calibrated or given): all of them, as the
    diagnosis does not list the run's formats."""
    own = {label: t.underflow_threshold(label) for label in {**FORMAT_UNDERFLOW_PCT, **t.format_underflow_pct}}
    return "underflow by format " + ", ".join(f"{label} > {pct:g}%" for label, pct in own.items())
