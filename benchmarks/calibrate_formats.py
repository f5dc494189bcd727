"""The underflow each format makes on well-behaved data: the calibration of ``diagnose``'s per-format thresholds.

Each format label (the statistics name of a recipe's casts, as routing records write it) casts well-behaved
samples with the very quantizers training uses (``lowprec.quantize``: the recipe's own quantizer for that tensor,
e.g. NVFP4's 16 x 16 weight blocks and stochastically rounded gradients), read as ``LogFp8TensorStats`` reads the
layer's own cast (``quantization_fields`` of the rowwise cast), and measures:

- ``underflows%``: non-zero values that become zero, in % of all the elements;
- ``rel_mse``: the mean squared error over the mean square of the tensor;
- for the block formats, per block as ``per_block_stats`` reads the cast (at its default ``block_underflow_threshold``,
  50): ``underflow_blocks%`` (blocks that flush more than half their non-zero values), ``saturated_blocks%`` (blocks
  with a saturated value: the OCP rule's E8M0 scales and NVFP4's E4M3 scales round down) and ``worst_block_rel_err``.

Samples (``SAMPLES``): activation-like N(0, 1) and Student-t with 3 degrees of freedom (heavy tails), a
weight-like N(0, 0.02), gradient-like N(0, 1) x 1e-6 and Laplace x 1e-6, each at 1024 x 1024 and 4096 x 256
(``SHAPES``), over ``--seeds`` seeds. Per format the table gives the median and the max over seeds of each sample,
and the threshold (``threshold``): ``MARGIN`` x the largest underflows% any well-behaved sample gives, rounded up to
a tenth of a percent, and never below ``FLOOR`` (``diagnose``'s per-tensor FP8 default: on well-behaved data
per-tensor FP8 flushes nothing, so its threshold stays what it was); per block format, likewise ``MARGIN`` x the
largest ``underflow_blocks%`` (never below ``BLOCK_FLOOR``), ``MARGIN`` x the largest ``worst_block_rel_err``, and for
the formats whose scales round down (well-behaved data saturates some blocks) a ``saturated_blocks%`` at which the
blocks that do not saturate are ``MARGIN`` times fewer than on well-behaved data (``saturation_threshold``). The
thresholds go into ``src/nvdlfw_inspect/diagnose/thresholds.py``'s ``FORMAT_UNDERFLOW_PCT``,
``FORMAT_UNDERFLOW_BLOCKS_PCT``, ``FORMAT_SATURATED_BLOCKS_PCT`` and ``FORMAT_WORST_BLOCK_ERR`` (``nvdlfw_inspect``
does not import ``lowprec``, so they are kept there as data); ``tests/nvdlfw_inspect/diagnose/test_format_thresholds.py`` checks
that the table still holds what this measures.

Run: ``python benchmarks/calibrate_formats.py [--seeds N] [--formats nvfp4,mxfp8] [--small]``.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from collections.abc import Callable
from datetime import date

import torch
from harness import git_commit

import lowprec
from lowprec.debug.per_block_stats import DEFAULT_UNDERFLOW_THRESHOLD, block_partials
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
#: the least underflow_blocks% threshold: a block-format tensor with fewer flushing blocks is not a finding
BLOCK_FLOOR = 1.0


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


def measure(label: str, sample: str, shape: tuple[int, int], seed: int) -> dict[str, float]:
    """``under`` (underflows%) and ``mse`` (rel_mse) of one sample cast as ``label``'s recipe casts its tensor, and
    for a block format ``blocks`` (underflow_blocks%), ``saturated`` (saturated_blocks%), ``worst`` (worst_block_rel_err)."""
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
    measured = {
        "under": 100.0 * float(fields["underflows"]) / x.numel(),
        "mse": float(fields["sq_err"]) / float(x.double().square().sum()),
    }
    if q.part is not None:
        blocks, _ = block_partials(x, q, DEFAULT_UNDERFLOW_THRESHOLD)
        measured["blocks"] = 100.0 * float(blocks["underflows"]) / blocks["count"]
        measured["saturated"] = 100.0 * float(blocks["overflows"]) / blocks["count"]
        measured["worst"] = float(blocks["max"])
    return measured


def calibrate(
    labels: tuple[str, ...] = tuple(RECIPE_OF), shapes: tuple[tuple[int, int], ...] = SHAPES, seeds: int = 3
) -> dict[str, dict[tuple[str, tuple[int, int]], dict[str, float]]]:
    """Per label, per (sample, shape): the median and max over ``seeds`` of each of ``measure``'s values
    (``under_median``, ``under_max``, ``mse_median``, ...)."""
    table: dict[str, dict[tuple[str, tuple[int, int]], dict[str, float]]] = {}
    for label in labels:
        rows = table.setdefault(label, {})
        for sample in SAMPLES:
            for shape in shapes:
                measured = [measure(label, sample, shape, seed) for seed in range(seeds)]
                row = rows[(sample, shape)] = {}
                for key in measured[0]:
                    values = [m[key] for m in measured]
                    row[f"{key}_median"], row[f"{key}_max"] = statistics.median(values), max(values)
    return table


def largest(rows: dict[tuple[str, tuple[int, int]], dict[str, float]], key: str = "under") -> float:
    """The largest ``key`` (``under``: underflows%) of any well-behaved sample, rounded up to 0.001."""
    return math.ceil(max(row[f"{key}_max"] for row in rows.values()) * 1000 - 1e-9) / 1000


def threshold(rows: dict[tuple[str, tuple[int, int]], dict[str, float]], key: str = "under", floor: float = FLOOR) -> float:
    """``MARGIN`` x the largest ``key`` of any well-behaved sample, rounded up to 0.1 (``worst``: to 0.01), at least
    ``floor``."""
    step = 100 if key == "worst" else 10
    return max(floor, math.ceil(MARGIN * largest(rows, key) * step - 1e-9) / step)


def saturation_threshold(rows: dict[tuple[str, tuple[int, int]], dict[str, float]]) -> float | None:
    """The saturated_blocks% at which the blocks that do not saturate are ``MARGIN`` times fewer than the fewest of any
    well-behaved sample, rounded up to 0.1 (a multiple of a share near half would pass 100%); None where no sample
    saturates a block (NVIDIA's rule, FP8 block scaling: only an infinite value saturates, a NaN or inf finding)."""
    most = largest(rows, "saturated")
    return None if most == 0 else math.ceil((100 - (100 - most) / MARGIN) * 10 - 1e-9) / 10


def is_block(rows: dict[tuple[str, tuple[int, int]], dict[str, float]]) -> bool:
    return all("blocks_max" in row for row in rows.values())


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
    lines += [
        "",
        f"per block (block formats; threshold = max({BLOCK_FLOOR:g}, {MARGIN:g} x the largest max) for underflow_blocks%, "
        f"{MARGIN:g} x the largest max for worst_block_rel_err)",
        "",
        "| format | sample | shape | underflow_blocks% median / max | saturated_blocks% median / max | "
        "worst_block_rel_err median / max |",
        "|---|---|---|---|---|---|",
    ]
    for label, rows in table.items():
        for (sample, shape), row in rows.items() if is_block(rows) else ():
            cells = " | ".join(
                f"{row[f'{key}_median']:.3f} / {row[f'{key}_max']:.3f}" for key in ("blocks", "saturated", "worst")
            )
            lines.append(f"| {label} | {sample} | {shape[0]}x{shape[1]} | {cells} |")
    lines += [
        "",
        "| format | largest underflow_blocks% | threshold % | largest saturated_blocks% | threshold % | "
        "largest worst_block_rel_err | threshold |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, rows in table.items():
        if is_block(rows):
            lines.append(
                f"| {label} | {largest(rows, 'blocks'):.3f} | {threshold(rows, 'blocks', BLOCK_FLOOR):g} | "
                f"{largest(rows, 'saturated'):.3f} | {saturation_threshold(rows) or '-'} | {largest(rows, 'worst'):.3f} | "
                f"{threshold(rows, 'worst', 0):g} |"
            )
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
    print(f"# Format calibration ({date.today()}, commit {git_commit()}, torch {torch.__version__}, {platform.processor()})")
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
    block = {label: rows for label, rows in table.items() if is_block(rows)}
    for name, key, floor in (
        ("CALIBRATED_UNDERFLOW_BLOCKS_PCT", "blocks", None),
        ("FORMAT_UNDERFLOW_BLOCKS_PCT", "blocks", BLOCK_FLOOR),
        ("CALIBRATED_SATURATED_BLOCKS_PCT", "saturated", None),
        ("CALIBRATED_WORST_BLOCK_ERR", "worst", None),
        ("FORMAT_WORST_BLOCK_ERR", "worst", 0.0),
    ):
        print(f"{name} = {{")
        for label, rows in block.items():
            value = largest(rows, key) if floor is None else threshold(rows, key, floor)
            print(f'    "{label}": {value:g},')
        print("}")
    print("FORMAT_SATURATED_BLOCKS_PCT = {  # the formats whose scales round down")
    for label, rows in block.items():
        if (saturation := saturation_threshold(rows)) is not None:
            print(f'    "{label}": {saturation:g},')
    print("}")


if __name__ == "__main__":
    main()
