"""How the HTML report copes with a big run: a synthetic statistics log of many layers and steps.

Writes the log in our structured format (one JSON record per statistic, as ``StatisticsFile`` does),
then times each stage of ``nvdlfw-inspect report``: reading the records, building the page's data,
rendering, writing; prints the sizes of the log and of the page; the whole ``nvdlfw-inspect report`` and
``nvdlfw-inspect diagnose`` commands as a user runs them (seconds and peak memory, each in a process of its
own); and, when Chromium is installed, the time headless Chromium takes to load the page and run its
script (heatmaps, risk table, the first layers' charts). The layers are named alike but for their index, as
a mixture-of-experts model's are, so the diagnosis compares each with its peers.

Run: ``python benchmarks/report_scale.py [--layers 1000] [--steps 1000] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nvdlfw_inspect.logging import STATISTICS_RECORDS_DIR
from nvdlfw_inspect.reading import iter_statistics
from nvdlfw_inspect.report import render, report_data

STATS = (("activation", "underflows%"), ("activation", "dynamic_range"), ("activation", "max"), ("gradient", "underflows%"))


def write_synthetic_log(log_dir: Path, layers: int, steps: int) -> Path:
    """One rank's records: every layer drifts; layer 7 underflows more and more; one NaN at mid-run."""
    path = log_dir / STATISTICS_RECORDS_DIR / "nvdlfw_inspect_globalrank-0.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    with path.open("w", encoding="utf-8") as out:
        for step in range(steps):
            lines = []
            for layer in range(layers):
                name = f"model.layers.{layer}.mlp.fc1"
                drift = step / steps
                for tensor, stat in STATS:
                    value = rng.random() * (1 + drift) * (20 if layer == 7 else 1)
                    if layer == layers // 2 and step == steps // 2 and stat == "max":
                        value = math.nan
                    shown = json.dumps(value if math.isfinite(value) else str(value))
                    lines.append(
                        f'{{"layer": "{name}", "tensor": "{tensor}", "stat": "{stat}", '
                        f'"iteration": {step}, "value": {shown}, "rank": 0}}\n'
                    )
            out.write("".join(lines))
    return path


def timed(label: str, timings: list[tuple[str, float]], fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    timings.append((label, time.perf_counter() - start))
    return result


def command_cost(*args: str) -> tuple[float, float]:
    """Seconds and peak resident MiB of ``nvdlfw-inspect ARGS`` run in a process of its own."""
    start = time.perf_counter()
    code = "import sys; from lowprec.cli import main; sys.exit(main())"
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=errors)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            errors.seek(0)
            raise RuntimeError(f"nvdlfw-inspect {' '.join(args)} failed: {errors.read().decode()[-2000:]}")
    return seconds, usage.ru_maxrss / 1024


def browser_load_seconds(page: Path) -> float | None:
    """Seconds for headless Chromium to load the page and finish its script (None without Chromium)."""
    chromium = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if chromium is None:
        return None
    command = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--dump-dom", "--window-size=1300,1800"]
    start = time.perf_counter()
    result = subprocess.run([*command, page.resolve().as_uri()], capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    if 'data-ready="true"' not in result.stdout:
        raise RuntimeError(f"the page's script did not finish: {result.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--keep", type=Path, help="write the log and the page here instead of a temporary folder")
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="report_scale_"))
    timings: list[tuple[str, float]] = []
    log = timed("write synthetic log", timings, write_synthetic_log, folder, args.layers, args.steps)
    commands = {  # first, while this process is small: a child's peak memory counts what it shares after the fork
        "report": command_cost("report", str(folder), "-o", str(folder / "command_report.html")),
        "diagnose": command_cost("diagnose", str(folder)),
    }
    statistics = timed("read records", timings, lambda: list(iter_statistics(folder)))
    data = timed("build report data", timings, report_data, statistics, "synthetic run")
    page = timed("render HTML", timings, render, data)
    output = folder / "report.html"
    timed("write HTML", timings, output.write_text, page, "utf-8")
    load = browser_load_seconds(output)

    print(f"{args.layers} layers x {args.steps} steps x {len(STATS)} statistics = {len(statistics):,} records")
    print(f"{'stage':<28}{'seconds':>10}")
    for label, seconds in timings:
        print(f"{label:<28}{seconds:>10.2f}")
    report_seconds = sum(seconds for label, seconds in timings[1:])
    print(f"{'report total (read..write)':<28}{report_seconds:>10.2f}")
    for name, (seconds, mib) in commands.items():
        print(f"{'nvdlfw-inspect ' + name:<28}{seconds:>10.2f}   peak {mib:.0f} MiB")
    print(f"{'Chromium load + script':<28}{'n/a' if load is None else f'{load:.2f}':>10}")
    print(f"log size   {log.stat().st_size / 2**20:8.1f} MiB")
    print(f"page size  {output.stat().st_size / 2**20:8.1f} MiB")
    if args.keep is None:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
