"""What to change for a finding, with the features of the ``transformer_engine`` config namespace
(as Transformer Engine and ``lowprec`` define them), each choice explained in one sentence.

- overflow, or a scale that keeps jumping: delayed scaling's scale, made from earlier amaxes, lags the
  tensor; ``PerTensorScaling`` scales it by its own amax.
- underflow: by the tensor's dynamic range (or what current scaling would lose, where logged):
  within its format's range, the scale lags (``PerTensorScaling``); beyond E4M3's but within E5M2's,
  ``FakeQuant`` in E5M2 tests the wider format; beyond every FP8 format's, or unknown, the GEMMs that
  read it run in high precision (``DisableFP8GEMM``).
- underflow in a block format (MXFP8, NVFP4, ...): every block has its own scale, so no per-tensor scale helps;
  the next rung of ``in_format`` keeps the format (an option its designers found) or a wider block format, as a
  rule of a precision plan; high precision when none is left.
- dynamic range beyond the format's with no underflows% logged: the same choice by range.
- blocks that flush or saturate, or a worst block beyond its format's calibrated error (the per-block statistics):
  the same, the GEMMs that read it run in high precision.
- growth over the run (kurtosis, the outlier-channel ratio, a scale): what the literature gives is a change to the
  model or the learning rate (``GROWTH_ADVICE``, in the finding's message); the config keeps the growth from
  costing precision meanwhile: the first GEMM that reads the tensor in high precision (an outlier channel sets
  the scale of the others), ``PerTensorScaling`` for a drifting scale (delayed scaling's lags it).
- NaN or inf: statistics of every GEMM tensor at every iteration around the first one, to find the
  operation that made it; where it came out of a GEMM of finite operands, that GEMM in high precision.
"""

from __future__ import annotations

from nvdlfw_inspect.diagnose import in_format
from nvdlfw_inspect.diagnose.formats import INPUTS, TENSOR_GEMMS
from nvdlfw_inspect.diagnose.model import Finding, Remedy
from nvdlfw_inspect.diagnose.thresholds import FORMAT_RANGE_BITS

OUTPUTS = ("output", "dgrad", "wgrad")
WIDE_FORMAT = "FP8E5M2"
WATCH_TENSORS = ["activation", "weight", "gradient", "output", "dgrad", "wgrad"]
WATCH_STATS = ["min", "max"]
#: per growth finding, the change the literature gives, which no config feature makes
OUTLIER_ADVICE = (
    "smooth the channel before the GEMM that reads it (per-channel scaling of the activation feeding it, as "
    "Smooth-SwiGLU scales the SwiGLU output: Fishman et al., arXiv 2409.12517), change the block so that kurtosis does "
    "not grow in FP8 training (FOG: Hernández-Cano et al., arXiv 2505.20524), or lower the learning rate"
)
GROWTH_ADVICE = {
    "kurtosis_growth": OUTLIER_ADVICE,
    "outlier_channel_growth": OUTLIER_ADVICE,
    "scale_drift": (
        "lower the learning rate (or warm it up longer); where the tensor is attention's query or key, normalize them "
        "(QK-layernorm keeps attention logits from growing under a high learning rate: Wortsman et al., arXiv "
        "2309.14322)"
    ),
}


def _gemms(tensor: str) -> tuple[str, ...]:
    return TENSOR_GEMMS.get(tensor, ())


def _listed(gemms: tuple[str, ...]) -> str:
    return " and ".join(gemms)


def per_tensor_scaling(finding: Finding, why: str) -> Remedy:
    return Remedy("PerTensorScaling", finding.layer, _gemms(finding.tensor), finding.tensor, why)


def by_range(finding: Finding, lost: str) -> Remedy:
    """The remedy that the tensor's dynamic range points to; ``lost`` says what the format loses."""
    tensor, fmt, span = finding.tensor, finding.context.get("element"), finding.context.get("dynamic_range")
    gemms = _gemms(tensor)
    if fmt is None or span is None:
        why = (
            f"{lost}, and without its dynamic_range logged the cause is unknown, so the GEMMs that read it "
            f"({_listed(gemms)}) run in high precision; log dynamic_range to see if PerTensorScaling or FP8E5M2 would do."
        )
        return Remedy("DisableFP8GEMM", finding.layer, gemms, None, why)
    if span <= FORMAT_RANGE_BITS[fmt]:
        return per_tensor_scaling(
            finding,
            f"{lost}, yet its values span {span:.1f} bits, within {fmt}'s {FORMAT_RANGE_BITS[fmt]:.1f}, so the scale lags "
            f"(delayed scaling keeps the larger amax of earlier iterations); PerTensorScaling takes it from the tensor's "
            f"own amax.",
        )
    if fmt != WIDE_FORMAT and span <= FORMAT_RANGE_BITS[WIDE_FORMAT]:
        why = (
            f"{lost}: its values span {span:.1f} bits, beyond {fmt}'s {FORMAT_RANGE_BITS[fmt]:.1f} but within "
            f"{WIDE_FORMAT}'s {FORMAT_RANGE_BITS[WIDE_FORMAT]:.1f}, so FakeQuant in {WIDE_FORMAT} (its GEMMs in high precision) "
            f"tests whether the wider format keeps them before you change the recipe."
        )
        return Remedy("FakeQuant", finding.layer, gemms, tensor, why, (("quant_format", WIDE_FORMAT),))
    why = (
        f"{lost}: its values span {span:.1f} bits, beyond every FP8 format's range ({WIDE_FORMAT}: "
        f"{FORMAT_RANGE_BITS[WIDE_FORMAT]:.1f}), so the GEMMs that read it ({_listed(gemms)}) run in high precision."
    )
    return Remedy("DisableFP8GEMM", finding.layer, gemms, None, why)


def per_block(finding: Finding, lost: str) -> Remedy:
    """For a tensor that a block format loses, the next rung that keeps a low-precision format (``in_format``: an
    option its designers found, else a wider block format, as a plan rule), high precision last. Its blocks' own
    scales cannot lag the tensor, so a per-tensor scale (PerTensorScaling, FakeQuant) would replace the format
    rather than repair it."""
    assert finding.format is not None
    return in_format.plan_remedy(finding, lost) or in_format.high_precision(finding, lost)


def for_underflow(finding: Finding) -> Remedy:
    lost = "It loses values to zero"
    if finding.format is not None and not finding.format.per_tensor:
        return per_block(finding, lost)
    current = finding.context.get("current_scaling_underflows")
    if current is not None and finding.summary is not None and current <= finding.summary.threshold:
        return per_tensor_scaling(
            finding,
            f"{lost} where current scaling would lose only {current:.3g}% (fp8_current_scaling_underflows%), so the "
            f"delayed scale lags; PerTensorScaling takes it from the tensor's own amax.",
        )
    return by_range(finding, lost)


def for_growth(finding: Finding) -> list[Remedy]:
    """What keeps a growth (``GROWTH_ADVICE``, the real remedy) from costing precision until the model is changed:
    for kurtosis or an outlier channel, the first GEMM that reads the tensor in high precision, where a recipe casts
    it; for a drifting scale, ``PerTensorScaling`` where delayed scaling may lag it (unknown or delayed)."""
    fmt, tensor = finding.format, finding.tensor
    if tensor not in INPUTS or (fmt is not None and fmt.label is None):
        return []  # no GEMM of this layer reads it, or none casts it
    if finding.kind == "scale_drift":
        if fmt is not None and fmt.label != "fp8_delayed_scaling":
            return []  # a scale from the tensor's own amax follows it
        why = (
            "A scale made from earlier amaxes lags a tensor that keeps growing, and its values saturate; "
            "PerTensorScaling takes it from each tensor's own amax (under current scaling already, the drift does not "
            "hurt the cast)."
        )
        return [per_tensor_scaling(finding, why)]
    gemm = _gemms(tensor)[0]
    why = (
        f"Its {finding.stat} grows, so a few values set the scale of the rest of its {tensor} and the others lose "
        f"precision in the {gemm} GEMM; {gemm} runs in high precision until the model change the finding names keeps it "
        "from growing."
    )
    return [Remedy("DisableFP8GEMM", finding.layer, (gemm,), None, why)]


def for_nonfinite(finding: Finding, first_iteration: int) -> list[Remedy]:
    """A statistics window around the first NaN or inf; and its GEMM in high precision when it came out
    of one whose operands were finite (they are inspected before it in the same iteration)."""
    start = finding.context.get("last_clean")
    start = first_iteration if start is None else start
    window = (("start_step", start), ("end_step", finding.first_iteration), ("freq", 1))
    watch = Remedy(
        "LogTensorStats",
        None,
        (),
        None,
        f"NaN or inf first appeared in {finding.layer}'s {finding.tensor} at iteration {finding.first_iteration}: min and "
        f"max of every GEMM tensor of every layer at each iteration from {start} to {finding.first_iteration} show the "
        f"first operation that made it.",
        window,
    )
    if finding.tensor not in OUTPUTS:
        return [watch]
    gemms = _gemms(finding.tensor)
    fix = Remedy(
        "DisableFP8GEMM",
        finding.layer,
        gemms,
        None,
        f"Its {gemms[0]} GEMM wrote NaN or inf from operands that were still finite, so it runs in high precision.",
    )
    return [watch, fix]


def choose(finding: Finding, first_iteration: int) -> list[Remedy]:
    """The remedies of ``finding``; ``first_iteration``: the run's first, where a statistics window may start."""
    if finding.kind == "nonfinite":
        return for_nonfinite(finding, first_iteration)
    if finding.kind == "overflow":
        why = (
            "Its values saturate because delayed scaling's scale, made from earlier amaxes, lags a growing tensor; "
            "PerTensorScaling scales each tensor by its own amax, which cannot overflow."
        )
        return [per_tensor_scaling(finding, why)]
    if finding.kind == "scale_change":
        why = (
            "A scale made from earlier amaxes cannot follow an amax that jumps between iterations; PerTensorScaling "
            "takes it from each tensor's own amax (under current scaling already, the jumps are harmless)."
        )
        return [per_tensor_scaling(finding, why)]
    if finding.kind == "underflow":
        return [for_underflow(finding)]
    if finding.kind == "block_underflow":
        return [per_block(finding, "It flushes the values of whole blocks to zero")]
    if finding.kind == "block_saturation":
        return [per_block(finding, "Its blocks' largest values saturate")]
    if finding.kind == "block_error":
        return [per_block(finding, "Its worst block loses much of its values")]
    if finding.kind == "dynamic_range":
        return [by_range(finding, "Its smallest values flush to zero")]
    if finding.kind in GROWTH_ADVICE:
        return for_growth(finding)
    if finding.kind == "peer_outlier":
        return []  # no precision setting repairs a tensor unlike its peers: the finding's message says where to look
    raise ValueError(f"no remedy for a finding of kind {finding.kind!r}")
