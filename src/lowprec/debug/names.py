"""Names of tensors and GEMMs in the debug protocol, and which GEMMs consume which tensor."""

from __future__ import annotations

GEMMS = ("fprop", "dgrad", "wgrad")
INPUT_TENSORS = ("activation", "weight", "gradient")
OUTPUT_TENSORS = ("output", "dgrad", "wgrad")
TENSORS = INPUT_TENSORS + OUTPUT_TENSORS
#: the tensors of the backward GEMMs: what a reentrant checkpoint's recomputed graph shows the inspection features
BACKWARD_TENSORS = ("gradient", "dgrad", "wgrad")

#: tensor -> (the GEMM that uses it as it is laid out, the GEMM that uses its transpose or None)
TENSOR_GEMMS: dict[str, tuple[str, str | None]] = {
    "activation": ("fprop", "wgrad"),
    "weight": ("fprop", "dgrad"),
    "gradient": ("dgrad", "wgrad"),
    "output": ("fprop", None),
    "wgrad": ("wgrad", None),
    "dgrad": ("dgrad", None),
}

#: the order in which a layer asks about its tensors (the reference's construction order)
ROUTING_ORDER = ("activation", "weight", "output", "dgrad", "wgrad", "gradient")
