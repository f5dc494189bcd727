"""Checks everything on a GPU in one run: the CUDA tests, every benchmark, and one table of their
measures against the targets.

Run through ``scripts/gpu_check.sh OUT_DIR [--tiny] [--budget-seconds N]``, which puts ``src/`` and
``benchmarks/`` on ``PYTHONPATH``: it is meant for a lent machine with one H100, a copy of the tree and
no network. Each step is a subprocess with its own share of the budget (9 minutes by default); a step
that fails or runs out of time is reported and the next one still runs. Without CUDA (or with
``--tiny``) the same plan runs on the CPU at tiny sizes, so that the plan is tested where no GPU is.

Optional wheels in ``.whl/`` are installed (``pip install --no-index --no-deps --target``) into a
temporary directory each: ``torchao-*.whl`` is put on the tests' and the benchmarks' ``PYTHONPATH``;
``nvdlfw_inspect-*.whl`` (the reference, which shares our import name) is seen only by the reference's
worker processes (``$NVDLFW_INSPECT_REFERENCE_PATH``, see ``harness.reference_python``).

Writes to OUT_DIR: ``summary.md`` (also printed), ``results.json`` (every measure), ``environment.txt``,
``pytest_cuda.log`` and ``benchmarks.log`` (every benchmark's tables). Exits 0 once every step ran,
whatever the tests or the targets gave (a ``FAILED:`` line says so); 2 on a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
WHEELS = ROOT / ".whl"
BUDGET_SECONDS = 540  # the plan must fit in 9 minutes on an H100
RESERVE_SECONDS = 10  # kept back from the steps for the summary
TINY_VERDICT = "CPU plan (tiny sizes): not a target measurement"
PYTEST_TOTALS = re.compile(r"\b(passed|failed|skipped|deselected|errors?)\b.* in [\d.]+s")  # "3 passed, 1 skipped in 2.1s"
# Each step's share of the budget left when it starts (time a step leaves unused goes to the next ones).
SHARES = {
    "pytest": 0.26,
    "real_model": 0.21,
    "stats_overhead": 0.11,
    "engine": 0.21,
    "formats": 0.10,
    "host_cost": 0.07,
    "guard_cost": 0.04,
}
# What each benchmark runs: its arguments on a GPU, and in the tiny CPU plan.
BENCHMARK_ARGS = {
    "real_model": (["--size", "full", "--repeats", "3"], ["--size", "tiny", "--device", "cpu", "--steps", "2", "--repeats", "1"]),
    "stats_overhead": (
        ["--repeats", "3"],
        ["--device", "cpu", "--width", "64", "--depth", "2", "--tokens", "16", "--steps", "2", "--repeats", "1"]
        + ["--bandwidth-mib", "8"],
    ),
    "engine": (["--repeats", "3"], ["--tiny"]),
    "formats": ([], ["--tiny"]),
    "host_cost": ([], ["--tiny"]),
    "guard_cost": (
        ["--repeats", "5"],
        ["--device", "cpu", "--width", "64", "--depth", "2", "--tokens", "16", "--steps", "2", "--repeats", "1"]
        + ["--threads", "1"],
    ),
}
# Versions and device, read in a subprocess so that this process never holds a CUDA context.
PROBE = """
import json, platform, sys
from importlib import metadata
import torch
info = {"python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "device": "cpu"}
if info["cuda_available"]:
    props = torch.cuda.get_device_properties(0)
    info["device"] = props.name
    info["capability"] = f"{props.major}.{props.minor}"
    info["memory_gib"] = round(props.total_memory / 2**30, 1)
for name in ("triton", "transformers", "torchao", "pytest", "pytest-xdist", "pytest-timeout"):
    try:
        info[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        info[name] = None
print(json.dumps(info))
"""


@dataclass
class StepResult:
    name: str
    command: list[str]
    status: str  # "ok", "failed (exit N)", "timed out after N s", "not run: why"
    seconds: float = 0.0
    timeout: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class Reading:
    """One target's measured value, its table cell, whether it meets the target, and a note on the verdict."""

    value: float
    cell: str
    met: bool
    note: str = ""


@dataclass
class Target:
    measure: str
    target: str
    source: str  # a benchmark's name, or "pytest"
    read: Callable[[dict, dict[str, str | None]], Reading]  # (measures, why an optional part is missing) -> Reading


@dataclass
class Plan:
    out: Path
    tiny: bool
    work: Path  # temporary: the wheels' installations, the benchmarks' JSON, the JUnit XML
    budget: float
    deadline: float
    shares_left: dict[str, float] = field(default_factory=lambda: dict(SHARES))
    steps: list[StepResult] = field(default_factory=list)

    def allowance(self, name: str) -> float:
        """Seconds for step ``name``: its share of what is left of the budget, among the steps still to run."""
        share = self.shares_left.pop(name)
        left = self.deadline - time.monotonic() - RESERVE_SECONDS
        return left * share / (share + sum(self.shares_left.values()))


def run_step(plan: Plan, name: str, command: list[str], timeout: float, log: Path, env: dict[str, str]) -> StepResult:
    """Run ``command`` for at most ``timeout`` seconds, its output appended to ``log``; on timeout, end its
    process group."""
    printable = shlex.join(str(Path(part).relative_to(ROOT)) if part.startswith(str(ROOT)) else part for part in command)
    if timeout < 1:
        result = StepResult(name, command, "not run: the budget was spent")
    else:
        print(f"[gpu_check] {name}: {printable} (at most {timeout:.0f} s)", flush=True)
        start = time.monotonic()
        with log.open("a") as out:
            out.write(f"\n===== {name}: {printable} =====\n")
            out.flush()
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
            try:
                code = process.wait(timeout=timeout)
                status = "ok" if code == 0 else f"failed (exit {code})"
            except subprocess.TimeoutExpired:
                stop(process)
                status = f"timed out after {timeout:.0f} s"
            except KeyboardInterrupt:  # its own session does not see our Ctrl-C
                stop(process)
                raise
            result = StepResult(name, command, status, time.monotonic() - start, timeout)
            out.write(f"----- {name}: {status}, {result.seconds:.1f} s -----\n")
    print(f"[gpu_check] {name}: {result.status}", flush=True)
    plan.steps.append(result)
    return result


def stop(process: subprocess.Popen) -> None:
    """End a timed-out step and every process it started (workers, compilers): interrupted first, as
    Ctrl-C does (pytest then still writes its report of the tests that ran), killed 5 s later."""
    with contextlib.suppress(ProcessLookupError):  # it may have ended since
        os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def install_wheel(pattern: str, target: Path) -> tuple[Path | None, str]:
    """``(directory, what was installed)`` for the newest ``.whl/<pattern>``, or ``(None, why not)``."""
    wheels = sorted(WHEELS.glob(pattern))
    if not wheels:
        return None, f"no {pattern} in .whl/"
    command = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps"]
    result = subprocess.run([*command, "--no-compile", "--target", str(target), str(wheels[-1])], capture_output=True, text=True)
    if result.returncode != 0:
        return None, f"pip install {wheels[-1].name} failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}"
    return target, f"{wheels[-1].name} (from .whl/)"


def command_output(command: list[str]) -> str | None:
    """The command's stripped output, or None when it is missing or fails."""
    if shutil.which(command[0]) is None:
        return None
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    return result.stdout.strip() if result.returncode == 0 else None


def git_commit() -> str:
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    if not (ROOT / ".git").exists() or (commit := command_output(["git", "rev-parse", "HEAD"])) is None:
        return "unknown"
    return commit + (" (with uncommitted changes)" if command_output(["git", "status", "--porcelain"]) else "")


def environment(env: dict[str, str]) -> dict:
    """Versions, device and commit; the probe runs in a subprocess with the benchmarks' environment."""
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=ROOT)
    if probe.returncode != 0:
        raise SystemExit(f"gpu_check: {sys.executable} cannot import torch:\n{probe.stderr[-2000:]}")
    info = json.loads(probe.stdout)
    driver = command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    info["driver"] = driver.splitlines()[0] if driver else "unknown (no nvidia-smi)"
    info["commit"] = git_commit()
    info["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info["host"] = platform.node()
    return info


def junit_counts(path: Path) -> dict[str, int] | None:
    """Passed, failed, errors and skipped tests of a JUnit XML report (None when pytest wrote none)."""
    if not path.exists():
        return None
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {key: sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")}
    return {
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
    }


def run_cuda_tests(plan: Plan, info: dict, env: dict[str, str]) -> dict:
    """Every test marked ``cuda`` (those that skip without a GPU); their counts, or why there are none."""
    junit = plan.work / "junit.xml"
    timeout = plan.allowance("pytest")
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "-q", "-rs", "--junitxml", str(junit)]
    if info["pytest-xdist"] and not plan.tiny:
        command += ["-n", "8"]
    if info["pytest-timeout"]:  # a hung test fails alone, with its traceback, instead of the whole step
        command += ["--timeout", str(max(int(timeout * 0.8), 1))]
    log = plan.out / "pytest_cuda.log"
    step = run_step(plan, "pytest", command, timeout, log, env)
    if step.status == "failed (exit 5)":
        return {"status": "no CUDA tests ran: pytest collected none"}
    counts = junit_counts(junit)  # also after a timeout: the tests that ran
    if counts is None:
        return {"status": f"pytest {step.status} (see pytest_cuda.log)"}
    totals = [line.strip("= ") for line in log.read_text().splitlines() if PYTEST_TOTALS.search(line)]
    line = " ".join(totals[-1:] + ([] if step.ok else [f"(pytest {step.status})"]))
    return {"status": step.status, "counts": counts, "line": line}


def run_benchmarks(plan: Plan, env: dict[str, str]) -> dict[str, dict | str]:
    """Each benchmark's JSON measures, or why it has none."""
    log = plan.out / "benchmarks.log"
    results: dict[str, dict | str] = {}
    for name, (full_args, tiny_args) in BENCHMARK_ARGS.items():
        script = BENCHMARKS / f"{name}.py"
        output = plan.work / f"{name}.json"
        command = [sys.executable, str(script), *(tiny_args if plan.tiny else full_args), "--json", str(output)]
        step = run_step(plan, name, command, plan.allowance(name), log, env)
        if step.ok and output.exists():
            results[name] = json.loads(output.read_text())
        else:
            results[name] = f"benchmarks/{name}.py {step.status if not step.ok else 'wrote no JSON'} (see benchmarks.log)"
    return results


def reference_text(value: float | None, unit: str, reason: str | None) -> str:
    return f"reference 0.2.2: {value:.3g}{unit}" if value is not None else f"reference 0.2.2: not measured ({reason})"


def read_step_ratio(variant: str, limit: float) -> Callable[[dict, dict], Reading]:
    def read(m: dict, why: dict) -> Reading:
        value, ms = m["step_ratio"][variant], m["ms_per_step"]
        return Reading(value, f"{value:.3f}x ({ms[variant]:.2f} vs {ms['no debug']:.2f} ms/step)", value <= limit)

    return read


def read_plan(m: dict, why: dict) -> Reading:
    """The precision plan that has kernels on Hopper (FP8 current scaling, the last layer in BF16) against BF16, with
    FP8 and NVFP4 everywhere beside it."""
    ratio = m["step_ratio"]
    value = ratio["plan: FP8 current, last layer BF16"]
    cell = f"{value:.3f}x of BF16 (FP8 current everywhere {ratio['FP8 current']:.3f}x, NVFP4 everywhere {ratio['NVFP4']:.3f}x)"
    return Reading(value, cell, value < 1.0)


def read_kernels(m: dict, why: dict) -> Reading:
    if m["kernels_ratio_stats_freq_1"] is not None:
        value, per_step, what = m["kernels_ratio_stats_freq_1"], m["kernels_per_step"], "kernels/step"
    else:
        value, per_step, what = m["ops_ratio_stats_freq_1"], m["ops_per_step"], "ops/step, the CPU proxy"
    return Reading(value, f"{value:.2f}x ({per_step['stats freq 1']:.0f} vs {per_step['no debug']:.0f} {what})", value <= 1.5)


def read_syncs(m: dict, why: dict) -> Reading:
    """The synchronizations debugging adds to the training work (the model's own, such as transformers'
    ``torch.tensor`` calls, are in the no-debug step too and are not ours to remove)."""
    train, in_step = m["syncs_train_per_step"], m["syncs_in_step_per_step"]
    worst = max(count for variant, count in train.items() if variant != "no debug")
    value = worst - train["no debug"]
    proxy = "" if m["syncs_method"].startswith("CUDA") else "CPU proxy, "
    cell = (
        f"{value:g} per step beyond no debug ({proxy}worst debug variant {worst:g}, no debug {train['no debug']:g}; "
        f"inside step(): {max(in_step.values()):g})"
    )
    return Reading(value, cell, value <= 0)


def read_stats_bandwidth(m: dict, why: dict) -> Reading:
    value = m["stats_bandwidth_tbps"]
    cell = f"{value:.3g} TB/s (copy {m['copy_bandwidth_tbps']:.3g} TB/s; {m['bandwidth_mib']:g} MiB)"
    return Reading(value, cell, value >= 2.0)


def read_moments_bandwidth(m: dict, why: dict) -> Reading:
    value = m["moments_bandwidth_tbps"]
    cell = (
        f"{value:.3g} TB/s (without M3, M4: {m['stats_bandwidth_tbps']:.3g}; column amax {m['column_amax_bandwidth_tbps']:.3g})"
    )
    return Reading(value, cell, value >= 2.0)


def read_early_overhead(m: dict, why: dict) -> Reading:
    value = m["step_ratio_ours_early"]
    return Reading(value, f"{value:.3f}x (the six alone: {m['step_ratio_ours_stats']:.3f}x)", value <= 1.05)


def read_mlp_overhead(m: dict, why: dict) -> Reading:
    value = m["step_ratio_ours_stats"]
    reference = reference_text(m["step_ratio_reference_stats"], "x", why["reference"] or m["reference_missing_reason"])
    return Reading(value, f"{value:.3f}x ({reference})", value <= 1.05)


def read_cast(m: dict, why: dict) -> Reading:
    value, rates = m["cast_tbps"]["delayed cast + transpose"], m["cast_tbps"]
    return Reading(value, f"{value:.3g} TB/s (copy {rates['copy (ceiling)']:.3g} TB/s; {m['cast_mib']:g} MiB)", value >= 2.2)


def read_speedup(which: str) -> Callable[[dict, dict], Reading]:
    def read(m: dict, why: dict) -> Reading:
        speedup = m[f"{which}_fp8_speedup"]
        cell = f"{speedup['delayed']:.2f}x faster (delayed scaling; current {speedup['current']:.2f}x; {m[which]})"
        return Reading(speedup["delayed"], cell, speedup["delayed"] >= 1.3)

    return read


def read_compiled(m: dict, why: dict) -> Reading:
    ours, torchao = m["layer_compiled_fp8_current_ms"], m["layer_torchao_compiled_ms"]
    if torchao is not None:
        return Reading(ours, f"{ours:.2f} ms (torchao {torchao:.2f} ms; {m['layer']})", ours < torchao)
    reason = why["torchao"] or m["torchao_missing_reason"]
    cell = f"{ours:.2f} ms (torchao: not measured ({reason}); {m['layer']})"
    return Reading(ours, cell, ours < 3.53, note=" (vs the recorded 3.53 ms: torchao not measured here)")


def read_quantize(label: str) -> Callable[[dict, dict], Reading]:
    def read(m: dict, why: dict) -> Reading:
        rates = m["quantize_tbps"]
        value = rates[label]
        torch_rate = f"torch emulation {rates[label + ' (torch)']:.3g} TB/s; " if label + " (torch)" in rates else ""
        cell = f"{value:.3g} TB/s read ({torch_rate}copy {rates['copy (ceiling)']:.3g} TB/s; {m['quantize_mib']:g} MiB)"
        return Reading(value, cell, value >= 1.5)

    return read


def read_host_cost(key: str, limit: float, reference_key: str | None = None) -> Callable[[dict, dict], Reading]:
    def read(m: dict, why: dict) -> Reading:
        value = m[key]
        cell = f"{value:.1f} us"
        if reference_key is not None:
            reason = why["reference"] or m.get("reference_missing_reason")
            cell += f" ({reference_text(m[reference_key], ' us', reason)})"
        return Reading(value, cell, value <= limit)

    return read


def read_guard(m: dict, why: dict) -> Reading:
    value, ms = m["step_ratio"]["guard only"], m["ms_per_step"]
    cell = (
        f"{value:.3f}x ({ms['guard only']:.2f} vs {ms['no debug']:.2f} ms/step; "
        f"{m['extra_ops_per_guarded_tensor']:.1f} ops per guarded tensor, {m['host_reads_in_step']:g} host read in step())"
    )
    return Reading(value, cell, value <= 1.02)


def read_tests(m: dict, why: dict) -> Reading:
    counts, completed = m["counts"], m["status"] in ("ok", "failed (exit 1)")
    cell = f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, {counts['skipped']} skipped"
    cell += "" if completed else f" (pytest {m['status']}: the tests that ran)"
    met = completed and counts["failed"] == counts["errors"] == counts["skipped"] == 0 and counts["passed"] > 0
    return Reading(counts["passed"], cell, met)


TARGETS = [
    Target("Llama-style model (full size), every statistic at freq 1: step ratio to no debug", "<= 1.15x", "real_model",
           read_step_ratio("stats freq 1", 1.15)),
    Target("same, every statistic at freq 10", "<= 1.03x", "real_model", read_step_ratio("stats freq 10", 1.03)),
    Target("same, debug idle", "<= 1.01x", "real_model", read_step_ratio("debug idle", 1.01)),
    Target("same, kernels per step, every statistic vs none", "<= 1.5x", "real_model", read_kernels),
    Target("same, host synchronizations between two step() calls, added by debugging", "0", "real_model", read_syncs),
    Target("statistics operator, 128 MiB bf16", ">= 2.0 TB/s (copy: 2.9)", "stats_overhead", read_stats_bandwidth),
    Target("stats_overhead MLP step ratio, ours (reference 0.2.2: 1.66)", "<= 1.05x", "stats_overhead", read_mlp_overhead),
    Target("statistics operator with M3 and M4 (kurtosis), 128 MiB bf16", ">= 2.0 TB/s, as without", "stats_overhead",
           read_moments_bandwidth),
    Target("same MLP, the six and the early-warning statistics (kurtosis, rms, channels)", "<= 1.05x, as the six",
           "stats_overhead", read_early_overhead),
    Target("delayed cast with transpose, 128 MiB bf16", ">= 2.2 TB/s", "engine", read_cast),
    Target("8 x Linear(4096) MLP: FP8 step vs bf16", ">= 1.3x faster", "engine", read_speedup("mlp")),
    Target("8192 layer: FP8 step vs bf16", ">= 1.3x faster", "engine", read_speedup("layer")),
    Target("compiled FP8 step (current scaling, fullgraph), 8192 layer", "faster than torchao's compiled Float8Linear (3.53 ms)",
           "engine", read_compiled),
    Target("MXFP8 quantize, 128 MiB bf16", ">= 1.5 TB/s", "formats", read_quantize("MXFP8")),
    Target("FP8 block quantize, 128 MiB bf16", ">= 1.5 TB/s", "formats", read_quantize("FP8 block scaling")),
    Target("NVFP4 quantize, 128 MiB bf16", ">= 1.5 TB/s", "formats", read_quantize("NVFP4")),
    Target("precision plan (FP8 current, last layer BF16), 4 x Linear(4096) step", "faster than BF16", "formats", read_plan),
    Target("host cost: routed log_tensor_stats call (six statistics, its share of step() included)", "<= 15 us", "host_cost",
           read_host_cost("log_tensor_stats_call_us", 15, "reference_log_tensor_stats_call_us")),
    Target("host cost per inspected tensor of a lowprec layer (LogTensorStats + LogFp8TensorStats)", "<= 15 us", "host_cost",
           read_host_cost("lowprec_inspected_tensor_us", 15)),
    Target("host cost of a step() with nothing to log", "<= 20 us", "host_cost",
           read_host_cost("empty_step_us", 20, "reference_empty_step_us")),
    Target("guard only (NonfiniteGuard on every layer, 8 x lowprec.Linear(4096) MLP): step ratio to no debug", "<= 1.02x",
           "guard_cost", read_guard),
    Target("CUDA tests", "all pass", "pytest", read_tests),
]  # fmt: skip


def target_rows(sources: dict[str, dict | str], why: dict[str, str | None], tiny: bool) -> list[dict]:
    """One row per target: measure, measured cell, target, verdict, and the value compared."""
    rows = []
    for target in TARGETS:
        source = sources[target.source]
        row = {"measure": target.measure, "target": target.target, "value": None}
        if isinstance(source, str):
            row["measured"], row["verdict"] = "-", f"not measured: {source}"
        else:
            try:
                reading = target.read(source["measures"], why)
            except (KeyError, TypeError) as error:
                row["measured"] = "-"
                row["verdict"] = f"not measured: benchmarks/{target.source}.py's JSON: {type(error).__name__} {error}"
            else:
                row["measured"], row["value"] = reading.cell, reading.value
                if tiny:
                    row["verdict"] = TINY_VERDICT
                else:
                    row["verdict"] = ("met" if reading.met else "MISSED") + reading.note
        rows.append(row)
    return rows


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def summary_markdown(info: dict, plan: Plan, rows: list[dict], tests: dict, wheels: dict[str, str], used: float) -> str:
    mode = "CPU plan at tiny sizes" if plan.tiny else "full plan"
    device = info["device"] + (
        f" (compute capability {info['capability']}, {info['memory_gib']} GiB)" if "capability" in info else ""
    )
    facts = [
        ("device", device),
        ("driver", info["driver"]),
        ("torch", f"{info['torch']} (CUDA {info['cuda'] or 'none'})"),
        ("Triton", info["triton"] or "not installed"),
        ("transformers", info["transformers"] or "not installed"),
        ("torchao", info["torchao"] or f"not installed ({wheels['torchao']})"),
        ("reference nvdlfw_inspect", wheels["reference"]),
        ("Python", f"{info['python']} ({info['executable']})"),
        ("commit", info["commit"]),
        ("date", info["date"]),
        ("budget", f"{used:.0f} s used of {plan.budget:.0f} s"),
    ]
    lines = [f"# GPU check: {info['device']}, {mode}", "", "| | |", "|---|---|"]
    lines += [f"| {name} | {cell(str(value))} |" for name, value in facts]
    lines += ["", "## Steps", "", "| step | status | seconds | allowed |", "|---|---|---|---|"]
    lines += [f"| {step.name} | {cell(step.status)} | {step.seconds:.1f} | {step.timeout:.0f} |" for step in plan.steps]
    lines += ["", f"CUDA tests: {tests.get('line') or tests['status']}"]
    lines += ["", "## Targets (H100, eager unless said)", "", "| measure | measured | target | verdict |", "|---|---|---|---|"]
    lines += [
        f"| {cell(row['measure'])} | {cell(row['measured'])} | {cell(row['target'])} | {cell(row['verdict'])} |" for row in rows
    ]
    lines += ["", *verdict_lines(plan, rows, tests)]
    return "\n".join(lines) + "\n"


def verdict_lines(plan: Plan, rows: list[dict], tests: dict) -> list[str]:
    """``FAILED:`` lines for the tests and the steps that did not succeed, then the targets' tally."""
    lines = [f"FAILED: {step.name}: {step.status}" for step in plan.steps if not step.ok]
    counts = tests.get("counts")
    if counts and (counts["failed"] or counts["errors"]):
        lines.append(f"FAILED: CUDA tests: {counts['failed']} failed, {counts['errors']} errors (see pytest_cuda.log)")
    if not lines:
        lines.append("OK: every step ran")
    if not plan.tiny:
        verdicts = [row["verdict"].split(" ")[0] for row in rows]
        lines.append(
            f"targets: {verdicts.count('met')} met, {verdicts.count('MISSED')} MISSED, {verdicts.count('not')} not measured"
        )
    return lines


def write_outputs(plan: Plan, info: dict, tests: dict, benchmarks: dict, wheels: dict[str, str], why: dict, used: float) -> None:
    """summary.md (also printed), results.json and environment.txt."""
    sources = {**benchmarks, "pytest": {"measures": tests} if "counts" in tests else tests["status"]}
    rows = target_rows(sources, why, plan.tiny)
    summary = summary_markdown(info, plan, rows, tests, wheels, used)
    (plan.out / "summary.md").write_text(summary)
    facts = [f"{key}: {value}" for key, value in info.items()] + [f"{name} wheel: {text}" for name, text in wheels.items()]
    smi = command_output(["nvidia-smi"]) or "nvidia-smi: not available"
    (plan.out / "environment.txt").write_text("\n".join([*facts, "", smi]) + "\n")
    results = {
        "mode": "tiny" if plan.tiny else "full",
        "budget_seconds": plan.budget,
        "seconds": used,
        "environment": info,
        "wheels": wheels,
        "steps": [asdict(step) for step in plan.steps],
        "cuda_tests": tests,
        "benchmarks": benchmarks,
        "targets": rows,
    }
    (plan.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for summary.md, results.json and the logs")
    parser.add_argument("--tiny", action="store_true", help="the CPU plan at tiny sizes (the default without CUDA)")
    parser.add_argument("--budget-seconds", type=float, default=BUDGET_SECONDS, help="time for the whole plan")
    args = parser.parse_args()
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("pytest_cuda.log", "benchmarks.log"):
        (args.out / name).write_text("")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work_dir:
        work = Path(work_dir)
        torchao_dir, torchao = install_wheel("torchao-*.whl", work / "torchao")
        reference_dir, reference = install_wheel("nvdlfw_inspect-*.whl", work / "reference")
        base_env = dict(os.environ, PYTHONUNBUFFERED="1")
        if torchao_dir is not None:  # the tests' MX references and the benchmarks' comparison both import it
            base_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(torchao_dir), os.environ.get("PYTHONPATH")]))
        bench_env = dict(base_env, NVDLFW_INSPECT_REFERENCE_PATH=str(reference_dir or ""))
        info = environment(bench_env)
        tiny = args.tiny or not info["cuda_available"]
        if not args.tiny and tiny:
            print("[gpu_check] no CUDA device: running the CPU plan at tiny sizes (checks the plan, not the targets)")
        plan = Plan(args.out, tiny, work, args.budget_seconds, deadline=start + args.budget_seconds)
        tests = run_cuda_tests(plan, info, base_env)
        benchmarks = run_benchmarks(plan, bench_env)
    wheels = {"torchao": torchao, "reference": reference}
    why = {"torchao": None if info["torchao"] else torchao, "reference": None if reference_dir else reference}
    write_outputs(plan, info, tests, benchmarks, wheels, why, time.monotonic() - start)


if __name__ == "__main__":
    main()
