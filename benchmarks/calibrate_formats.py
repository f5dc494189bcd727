"""The underflow each format makes on well-behaved data: the calibration of ``diagnose``'s per-format thresholds.

Each format label (the statistics name of a recipe's casts, as routing records write it) casts well-behaved
samples with the very quantizers training uses (``lowprec.quantize``: the recipe's own quantizer for that tensor,
e.g. NVFP4's 16 x 16 weight blocks and stochastically rounded gradients), read as ``LogFp8TensorStats`` reads the
layer's own cast (``quantization_fields`` of the rowwise cast), and measures:

- ``underflows%``: non-zero values that become zero, in % of all the elements;
- ``rel_mse``: the mean squared error over the mean square of the tensor.

Samples (``SAMPLES``): activation-like N(0, 1) and Student-t with 3 degrees of freedom (heavy tails), a
weight-like N(0, 0.02), gradient-like N(0, 1) x 1e-6 and Laplace x 1e-6, each at 1024 x 1024 and 4096 x 256
(``SHAPES``), over ``--seeds`` seeds. Per format the table gives the median and the max over seeds of each sample,
and the threshold (``threshold``): ``MARGIN`` x the largest underflows% any well-behaved sample gives, rounded up to
a tenth of a percent, and never below ``FLOOR`` (``diagnose``'s per-tensor FP8 default: on well-behaved data
per-tensor FP8 flushes nothing, so its threshold stays what it was). The thresholds go into
``src/nvdlfw_inspect/diagnose/thresholds.py``'s ``FORMAT_UNDERFLOW_PCT`` (``nvdlfw_inspect`` does not import
``lowprec``, so they are kept there as data); ``tests/nvdlfw_inspect/diagnose/test_format_thresholds.py`` checks
that the table still holds what this measures.

Run: ``python benchmarks/calibrate_formats.py [--seeds N] [--formats nvfp4,mxfp8] [--small]``.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from datetime import date

import torch

import lowprec
from lowprec.debug.quantized_stats import from_block, per_tensor, quantization_fields
from lowprec.plan.recipes import named_recipe
from lowprec.quant.protocol import Float8Tensor

#: format label -> the short recipe name that makes it (``lowprec.plan.recipes.NAMED``)
RECIPE_OF = {
    "fp8_delayed_scaling": "delayed",
    "fp8_current_scaling": "current",
    "fp8_block_scaling": "block",
    "mxfp8": "mxfp8",
    "mxfp8_ocp": "mxfp8_ocp",
    "mxfp6_e3m2": "mxfp6_e3m2",
    "mxfp6_e2m3": "mxfp6_e2m3",
    "mxfp4": "mxfp4",
    "mxfp4_nvidia": "mxfp4_nvidia",
    "nvfp4": "nvfp4",
}
SHAPES = ((1024, 1024), (4096, 256))
SMALL_SHAPES = ((256, 256),)
MARGIN = 2.0
FLOOR = 1.0


def _student_t(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """Student-t with 3 degrees of freedom: a normal over the root of a chi-squared(3) / 3."""
    normal = torch.randn(shape, generator=gen)
    chi2 = torch.randn((*shape, 3), generator=gen).square().sum(-1)
    return normal / (chi2 / 3).sqrt()


def _laplace(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    u = torch.rand(shape, generator=gen).clamp_min(1e-12)
    sign = torch.randint(0, 2, shape, generator=gen).float() * 2 - 1
    return -torch.log(u) * sign


#: name -> (the tensor of the layer it stands for, how it is drawn)
SAMPLES: dict[str, tuple[str, Callable[[tuple[int, int], torch.Generator], torch.Tensor]]] = {
    "act gauss": ("activation", lambda shape, gen: torch.randn(shape, generator=gen)),
    "act t3": ("activation", _student_t),
    "weight gauss": ("weight", lambda shape, gen: 0.02 * torch.randn(shape, generator=gen)),
    "grad gauss 1e-6": ("gradient", lambda shape, gen: 1e-6 * torch.randn(shape, generator=gen)),
    "grad laplace 1e-6": ("gradient", lambda shape, gen: 1e-6 * _laplace(shape, gen)),
}


def measure(label: str, sample: str, shape: tuple[int, int], seed: int) -> tuple[float, float]:
    """``(underflows%, rel_mse)`` of one sample cast as ``label``'s recipe casts its tensor."""
    tensor_name, draw = SAMPLES[sample]
    gen = torch.Generator().manual_seed(seed * 100_003 + shape[0])  # each shape its own draw
    x = draw(shape, gen)
    recipe = named_recipe(RECIPE_OF[label], **({"seed": seed} if label == "nvfp4" else {}))
    view = lowprec.quantize(x, recipe, tensor_name)
    cast = view.quantized
    if isinstance(cast, Float8Tensor):
        q = per_tensor(cast)
    else:
        q = from_block(cast.rowwise, False) if cast.rowwise is not None else from_block(cast.columnwise, True)
    fields = quantization_fields(x, q, overflows=False)
    underflows = 100.0 * float(fields["underflows"]) / x.numel()
    rel_mse = float(fields["sq_err"]) / float(x.double().square().sum())
    return underflows, rel_mse


def calibrate(
    labels: tuple[str, ...] = tuple(RECIPE_OF), shapes: tuple[tuple[int, int], ...] = SHAPES, seeds: int = 3
) -> dict[str, dict[tuple[str, tuple[int, int]], dict[str, float]]]:
    """Per label, per (sample, shape): the median and max over ``seeds`` of underflows% and rel_mse."""
    table: dict[str, dict[tuple[str, tuple[int, int]], dict[str, float]]] = {}
    for label in labels:
        rows = table.setdefault(label, {})
        for sample in SAMPLES:
            for shape in shapes:
                measured = [measure(label, sample, shape, seed) for seed in range(seeds)]
                under = [m[0] for m in measured]
                mse = [m[1] for m in measured]
                rows[(sample, shape)] = {
                    "under_median": statistics.median(under),
                    "under_max": max(under),
                    "mse_median": statistics.median(mse),
                    "mse_max": max(mse),
                }
    return table


def largest(rows: dict[tuple[str, tuple[int, int]], dict[str, float]]) -> float:
    """The largest underflows% of any well-behaved sample, rounded up to 0.001."""
    return math.ceil(max(row["under_max"] for row in rows.values()) * 1000 - 1e-9) / 1000


def threshold(rows: dict[tuple[str, tuple[int, int]], dict[str, float]]) -> float:
    """``MARGIN`` x the largest underflows% of any well-behaved sample, rounded up to 0.1, at least ``FLOOR``."""
    return max(FLOOR, math.ceil(MARGIN * largest(rows) * 10 - 1e-9) / 10)


def markdown(table: dict[str, dict[tuple[str, tuple[int, int]], dict[str, float]]], seeds: int) -> str:
    lines = [
        f"underflows% and relative mse over {seeds} seeds (median / max); threshold = max(1, {MARGIN:g} x the largest max)",
        "",
        "| format | sample | shape | underflows% median | underflows% max | rel mse median | rel mse max |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, rows in table.items():
        for (sample, shape), row in rows.items():
            lines.append(
                f"| {label} | {sample} | {shape[0]}x{shape[1]} | {row['under_median']:.3f} | {row['under_max']:.3f} | "
                f"{row['mse_median']:.3g} | {row['mse_max']:.3g} |"
            )
    lines += ["", "| format | largest underflows% | threshold % |", "|---|---|---|"]
    for label, rows in table.items():
        lines.append(f"| {label} | {largest(rows):.3f} | {threshold(rows):g} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--formats", default=",".join(RECIPE_OF), help="comma-separated format labels")
    parser.add_argument("--small", action="store_true", help="one 256 x 256 shape (a quick check)")
    args = parser.parse_args()
    labels = tuple(label.strip() for label in args.formats.split(","))
    torch.set_num_threads(1)
    start = time.perf_counter()
    table = calibrate(labels, SMALL_SHAPES if args.small else SHAPES, args.seeds)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    print(f"# Format calibration ({date.today()}, commit {commit.strip()}, torch {torch.__version__}, {platform.processor()})")
    print(f"machine: {platform.machine()} {platform.system()}, 1 thread, CPU; {time.perf_counter() - start:.0f} s\n")
    print(markdown(table, args.seeds))
    print("CALIBRATED_UNDERFLOW_PCT = {")
    for label, rows in table.items():
        print(f'    "{label}": {largest(rows)},')
    print("}")
    print("FORMAT_UNDERFLOW_PCT = {  # the others keep Thresholds.underflow_pct")
    for label, rows in table.items():
        if threshold(rows) > FLOOR:
            print(f'    "{label}": {threshold(rows):g},')
    print("}")


if __name__ == "__main__":
    main()
