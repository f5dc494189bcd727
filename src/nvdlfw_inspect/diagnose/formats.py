"""Which format each layer's GEMMs read each tensor in, from the run's routing records.

Under a precision plan each layer and GEMM runs its own recipe, and each routing record names the format its GEMM
reads the tensor in (``format``: the recipe's statistics name, ``nvfp4``, ``fp8_current_scaling``, ...). A tensor's
statistics without a recipe prefix (``underflows%``) describe its first GEMM's cast (fprop's for the activation and
the weight, dgrad's for the gradient; the second's where the first runs no recipe), so a finding is about that
format. The checks of a per-tensor scale (a dynamic range against an FP8 element's, a scale that jumps) apply only
where a GEMM reads the tensor with one: not to block formats, whose every block has its own scale, nor to high
precision. Where the records name no format (runs of older versions, other frameworks), the run has one per-tensor
FP8 format, ``Thresholds.fp8_format``, as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nvdlfw_inspect.diagnose.thresholds import Thresholds
from nvdlfw_inspect.reading import RoutingRecord

#: a layer's GEMMs, in the order configs and messages list them
GEMMS = ("fprop", "dgrad", "wgrad")
#: the GEMMs that read each input tensor, or that write each output tensor
TENSOR_GEMMS = {
    "activation": ("fprop", "wgrad"),
    "weight": ("fprop", "dgrad"),
    "gradient": ("dgrad", "wgrad"),
    "output": ("fprop",),
    "dgrad": ("dgrad",),
    "wgrad": ("wgrad",),
}
INPUTS = ("activation", "weight", "gradient")
#: the formats with one scale per tensor (their FP8 element, E4M3 or E5M2, is ``Thresholds.fp8_format``'s)
PER_TENSOR = ("fp8_delayed_scaling", "fp8_current_scaling")
#: formats in words where upper case does not do (as the report's precision map writes them)
_NAMES = {
    "fp8_delayed_scaling": "FP8 delayed scaling",
    "fp8_current_scaling": "FP8 current scaling",
    "fp8_block_scaling": "FP8 block scaling",
}

#: how each format scales what it casts, the mechanism a finding about its losses names
MECHANISMS = {
    "fp8_delayed_scaling": "one scale for the whole tensor, from a stale amax history",
    "fp8_current_scaling": "one scale for the whole tensor, from its own amax",
    "fp8_block_scaling": "a scale per block (FP32 scales per 1 x 128 values, per 128 x 128 of a weight)",
    "mxfp8": "a scale per block of 32 values (E8M0 power-of-two scales)",
    "mxfp8_ocp": "a scale per block of 32 values (E8M0 power-of-two scales, the OCP rule)",
    "mxfp6_e3m2": "a scale per block of 32 values (E8M0 power-of-two scales, E3M2 elements)",
    "mxfp6_e2m3": "a scale per block of 32 values (E8M0 power-of-two scales, E2M3 elements)",
    "mxfp4": "a scale per block of 32 values (E8M0 power-of-two scales, E2M1 elements)",
    "mxfp4_nvidia": "a scale per block of 32 values (E8M0 power-of-two scales rounded up, E2M1 elements)",
    "nvfp4": "a scale per block of 16 values (E4M3 scales, 16 x 16 of a weight, and a per-tensor FP32 scale; E2M1 elements)",
}

#: the block formats whose scale rule rounds down, and how that saturates a block (``saturated_blocks%``)
_OCP_SATURATES = "E8M0 scales rounded down by the OCP rule let a block's largest values saturate"
SATURATING_RULES = {
    "mxfp8_ocp": _OCP_SATURATES,
    "mxfp6_e3m2": _OCP_SATURATES,
    "mxfp6_e2m3": _OCP_SATURATES,
    "mxfp4": _OCP_SATURATES,
    "nvfp4": "E4M3 block scales rounded to nearest (down in about half the blocks) let a block's largest values saturate",
}


def format_name(label: str | None) -> str:
    """A format's statistics name in words (``mxfp6_e3m2``: ``MXFP6 E3M2``); None: high precision."""
    return "high precision" if label is None else _NAMES.get(label, label.upper().replace("_", " "))


@dataclass(frozen=True)
class TensorFormat:
    """How a layer reads one tensor: ``gemms``, (GEMM, format) for each GEMM of ``TENSOR_GEMMS[tensor]`` (for an
    output, the format its GEMM reads its operands in), the format None where that GEMM runs no recipe."""

    gemms: tuple[tuple[str, str | None], ...]

    @property
    def label(self) -> str | None:
        """The format its statistics describe: its first GEMM's, else its second's; None in high precision."""
        return next((label for _, label in self.gemms if label is not None), None)

    @property
    def per_tensor(self) -> bool:
        """Whether a GEMM reads it with one scale for the whole tensor (per-tensor FP8)."""
        return any(label in PER_TENSOR for _, label in self.gemms)

    @property
    def uniform(self) -> bool:
        """Whether its GEMMs read it in one format."""
        return len({label for _, label in self.gemms}) == 1

    @property
    def measured(self) -> str:
        """The format its statistics describe, in words; where its GEMMs differ, with the GEMM whose cast it is."""
        gemm = next((gemm for gemm, label in self.gemms if label == self.label), self.gemms[0][0])
        return format_name(self.label) if self.uniform else f"{format_name(self.label)} ({gemm}'s cast)"

    def __str__(self) -> str:
        """``NVFP4``; where its GEMMs differ, each one's: ``MXFP8 in fprop, NVFP4 in wgrad``."""
        if self.uniform:
            return format_name(self.label)
        return ", ".join(f"{format_name(label)} in {gemm}" for gemm, label in self.gemms)

    def as_dict(self) -> dict[str, str | None]:
        return dict(self.gemms)


class Formats:
    """The format of every tensor of every layer of a run (``of``) from its routing records, and the FP8 element
    that bounds its dynamic range (``element``); ``thresholds`` give the element of per-tensor formats and of the
    tensors whose records name no format."""

    def __init__(self, records: Iterable[RoutingRecord], thresholds: Thresholds):
        self.thresholds = thresholds
        latest: dict[tuple[str, str], RoutingRecord] = {}
        for record in records:  # the end of the run: the latest iteration, on the lowest rank that wrote it
            kept = latest.get((record.layer, record.gemm))
            if record.tensor in INPUTS and (kept is None or (record.iteration, -record.rank) >= (kept.iteration, -kept.rank)):
                latest[(record.layer, record.gemm)] = record
        # (layer, GEMM): its format, None without a recipe; a GEMM whose record names no recipe's format is unknown
        self._gemms = {key: r.format if r.recipe else None for key, r in latest.items() if r.format is not None or not r.recipe}
        self._recorded = set(latest)
        # (layer, GEMM): its recipe as a plan's recipe spec, where the records say it
        self._specs = {key: r.recipe_spec for key, r in latest.items() if r.recipe and r.recipe_spec is not None}

    def recipes(self, layer: str) -> dict[str, dict | None] | None:
        """Each GEMM's recipe of ``layer`` as a plan's recipe spec (None: high precision), from which a remedy that
        changes one option keeps the others; None unless the records say it for every GEMM."""
        found = {}
        for gemm in GEMMS:
            if (layer, gemm) not in self._gemms:
                return None
            if self._gemms[(layer, gemm)] is None:
                found[gemm] = None
            elif (layer, gemm) in self._specs:
                found[gemm] = dict(self._specs[(layer, gemm)])
            else:
                return None
        return found

    def labels(self) -> set[str | None] | None:
        """The formats the run's GEMMs read their operands in (None among them: high precision); None where the
        records name no format for some GEMM under a recipe (older versions, other frameworks) or there are none."""
        if not self._gemms or len(self._gemms) < len(self._recorded):
            return None
        return set(self._gemms.values())

    def of(self, layer: str, tensor: str) -> TensorFormat | None:
        """The format ``layer`` reads ``tensor`` in; None where the records do not say (no record, or no format)."""
        gemms = TENSOR_GEMMS.get(tensor, ())
        if not gemms or any((layer, gemm) not in self._gemms for gemm in gemms):
            return None
        return TensorFormat(tuple((gemm, self._gemms[(layer, gemm)]) for gemm in gemms))

    def without_tensor_scale(self, layer: str, tensor: str) -> TensorFormat | None:
        """The format of a tensor no GEMM reads with a per-tensor scale (block formats, high precision), to which
        the per-tensor checks do not apply; None for the others and where the records do not say."""
        fmt = self.of(layer, tensor)
        return fmt if fmt is not None and not fmt.per_tensor else None

    def element(self, layer: str, tensor: str) -> str | None:
        """The FP8 element of ``tensor``'s per-tensor cast (FP8E4M3, FP8E5M2: ``Thresholds.format_of``, as a format's
        name does not say it); None without a per-tensor cast and for GEMM outputs, which stay in high precision."""
        return None if self.without_tensor_scale(layer, tensor) is not None else self.thresholds.format_of(tensor)

    def range_limit(self, layer: str, tensor: str) -> float | None:
        """The ``dynamic_range`` beyond which ``tensor`` of ``layer`` is a problem (``Thresholds.range_limit``);
        None where no per-tensor cast bounds it."""
        return None if self.element(layer, tensor) is None else self.thresholds.range_limit(tensor)
