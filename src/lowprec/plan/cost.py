"""What a GEMM costs in each format: the search's (``plan.search``) cost of an option.

By default, the bits a GEMM reads per operand value (the element's bits, plus its scale's share: an E8M0 byte per
32 values for MX, an E4M3 byte per 16 for NVFP4, an fp32 per 128 for FP8 block scaling; a per-tensor scale is
nothing) relative to BF16's 16, times the GEMM's share of the model's GEMM FLOPs. A layer's three GEMMs (fprop,
dgrad, wgrad) each do ``2 x tokens x in x out`` multiply-adds, so a GEMM's share is its layer's weight elements
over the sum of all GEMM layers' (tokens cancel; an expert is counted as if it took its share of the tokens).

On a named GPU (``GPU_SPEEDUP``) the cost is instead the GEMM's FLOPs share times its time in the format relative
to BF16 on that GPU, per GEMM direction where it was measured: a format the GPU has no tensor cores for (or that was
not measured there) is not offered (``formats_on``). Two sources: Transformer Engine's GEMM benchmark
(``benchmarks/gemm/benchmark_gemm.py``; its "GEMM Speedups Across Precisions" page, autocast mode, so each format's
per-step casts included: a 5B model, hidden 4096, on a B300 and an H200 NVL), and where TE publishes none, the
vendor's dense peak throughput (H100, B200), which the casts' cost makes an upper bound.
"""

from __future__ import annotations

from collections.abc import Mapping

from lowprec.plan.rules import GEMMS

BF16_BITS = 16.0
#: bits read per value, scales included, of each format (a plan's recipe name)
FORMAT_BITS = {
    "bf16": 16.0,
    "delayed": 8.0,
    "current": 8.0,
    "block": 8.0 + 32 / 128,
    "mxfp8": 8.0 + 8 / 32,
    "mxfp8_ocp": 8.0 + 8 / 32,
    "mxfp6_e3m2": 6.0 + 8 / 32,
    "mxfp6_e2m3": 6.0 + 8 / 32,
    "nvfp4": 4.0 + 8 / 16,
    "mxfp4": 4.0 + 8 / 32,
    "mxfp4_nvidia": 4.0 + 8 / 32,
}
#: dense tensor-core throughput relative to BF16 from NVIDIA's data sheets: H100 SXM (989 BF16, 1979 FP8 dense
#: TFLOPS; no FP6/FP4 tensor cores, and MX and NVFP4 block scaling need Blackwell), B200 (2.25 PFLOPS BF16, 4.5 FP8
#: and FP6, 9 FP4 dense)
_PEAK = {
    "h100": {"bf16": 1.0, "delayed": 2.0, "current": 2.0, "block": 2.0},
    "b200": {
        "bf16": 1.0,
        "delayed": 2.0,
        "current": 2.0,
        "block": 2.0,
        "mxfp8": 2.0,
        "mxfp8_ocp": 2.0,
        "mxfp6_e3m2": 2.0,
        "mxfp6_e2m3": 2.0,
        "nvfp4": 4.0,
        "mxfp4": 4.0,
        "mxfp4_nvidia": 4.0,
    },
}
#: Transformer Engine's measured per-layer GEMM milliseconds (fprop, dgrad, wgrad) in autocast mode, from its
#: "GEMM Speedups Across Precisions" documentation (docs/examples/gemm_profiling): hidden 4096, intermediate 16384,
#: 15,872 tokens
_TE_MS = {
    "b300": {
        "bf16": (4.196, 4.290, 4.272),
        "current": (2.879, 3.063, 3.205),
        "delayed": (2.486, 2.621, 2.695),
        "mxfp8": (2.847, 3.045, 3.092),
        "nvfp4": (1.932, 2.189, 2.331),
    },
    "h200": {
        "bf16": (10.653, 10.813, 10.548),
        "current": (6.503, 6.795, 6.987),
        "delayed": (6.188, 6.306, 6.484),
        "block": (7.425, 7.636, 7.821),
    },
}
#: per GPU, per format, per GEMM direction: the speedup over BF16
GPU_SPEEDUP: dict[str, dict[str, dict[str, float]]] = {
    **{gpu: {fmt: dict.fromkeys(GEMMS, x) for fmt, x in table.items()} for gpu, table in _PEAK.items()},
    **{
        gpu: {fmt: {g: bf16 / t for g, bf16, t in zip(GEMMS, table["bf16"], ms, strict=True)} for fmt, ms in table.items()}
        for gpu, table in _TE_MS.items()
    },
}


def gemm_shares(weights: Mapping[str, int]) -> dict[str, float]:
    """Each GEMM layer's share of one GEMM direction's FLOPs, from its weight elements (``in x out``)."""
    total = sum(weights.values())
    if total <= 0:
        raise ValueError("the GEMM layers have no weight elements to share the FLOPs by")
    return {layer: count / total for layer, count in weights.items()}


def formats_on(gpu: str | None, candidates: list[str]) -> list[str]:
    """The candidates a GPU has tensor cores for (all of them for the bits model, ``gpu`` None); a ``ValueError``
    names an unknown GPU or format."""
    unknown = [fmt for fmt in candidates if fmt not in FORMAT_BITS]
    if unknown:
        raise ValueError(f"unknown format {', '.join(unknown)}; known: {', '.join(FORMAT_BITS)}")
    if gpu is None:
        return list(candidates)
    if gpu not in GPU_SPEEDUP:
        raise ValueError(f"no published speedups for GPU {gpu!r}; known: {', '.join(GPU_SPEEDUP)} (or none: bits read)")
    return [fmt for fmt in candidates if fmt in GPU_SPEEDUP[gpu]]


def gemm_cost(share: float, fmt: str, gpu: str | None = None, gemm: str = "fprop") -> float:
    """The cost of GEMM direction ``gemm`` of a layer with FLOPs ``share`` in format ``fmt``: BF16 everywhere costs 1
    per GEMM direction (3 for the whole plan)."""
    if gpu is None:
        return share * FORMAT_BITS[fmt] / BF16_BITS
    return share / GPU_SPEEDUP[gpu][fmt][gemm]
