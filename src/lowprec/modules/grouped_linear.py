"""``lowprec.GroupedLinear``: Transformer Engine's ``GroupedLinear`` (the experts of a mixture of experts) in
emulated FP8, each expert GEMM its own debug layer ``{name}.gemm_{i}``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lowprec.errors import LowprecTypeError, LowprecValueError
from lowprec.modules.base import NamedModule
from lowprec.modules.grouped_gemm import GroupedGemm
from lowprec.modules.linear import init_linear_parameters


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LowprecValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_m_splits(m_splits: Sequence[int] | torch.Tensor, num_gemms: int, rows: int) -> list[int]:
    """``m_splits`` as a list of ``num_gemms`` non-negative ints adding up to ``rows`` (a tensor is read
    back to the host: the split sizes decide which rows each GEMM gets)."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1 or m_splits.is_floating_point() or m_splits.is_complex():
            raise LowprecTypeError(f"m_splits must be a 1-D integer tensor or a list of ints, got a tensor {m_splits!r}")
        m_splits = m_splits.tolist()
    if not isinstance(m_splits, (list, tuple)) or not all(isinstance(m, int) and not isinstance(m, bool) for m in m_splits):
        raise LowprecTypeError(f"m_splits must be a list of ints or a 1-D integer tensor, got {m_splits!r}")
    if len(m_splits) != num_gemms or any(m < 0 for m in m_splits) or sum(m_splits) != rows:
        raise LowprecValueError(
            f"m_splits must hold {num_gemms} non-negative row counts (one per GEMM) adding up to the input's {rows} rows, "
            f"got {list(m_splits)}"
        )
    return list(m_splits)


class GroupedLinear(NamedModule):
    """``num_gemms`` linear maps applied to consecutive row groups of one input: ``y[rows of group i] =
    x[rows of group i] W_i^T + b_i``, with ``weight`` one Parameter of shape ``(num_gemms, out_features,
    in_features)`` (``weight[i]`` is ``W_i``) and ``bias`` of shape ``(num_gemms, out_features)``.

    ``forward(inp, m_splits)``: ``inp`` of shape ``(..., in_features)`` whose flattened rows are grouped, group
    ``i`` holding the next ``m_splits[i]`` rows (a list of ints or a 1-D integer tensor), as Transformer Engine's
    ``GroupedLinear.forward(inp, m_splits)``.

    Inside ``lowprec.autocast`` each group's fprop, dgrad and wgrad GEMMs run in FP8 with its own quantizers
    (its own scales and amax history); outside it each group is exactly ``torch.nn.functional.linear``. Group
    ``i`` is the debug layer ``{name}.gemm_{i}`` (Transformer Engine's names): ``layer_name_regex_pattern:
    '.*gemm_1$'`` selects expert 1, ``layer_types: [grouped_linear]`` every expert. When an expert is inspected
    its token count is logged too (``{name}.gemm_{i}_activation_tokens``, see ``grouped_gemm``).
    """

    layer_types = ("grouped_linear",)

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        name: str | None = None,
        device: torch.device | str | None = None,
        params_dtype: torch.dtype | None = None,
    ):
        super().__init__(name)
        self.num_gemms = _positive_int("num_gemms", num_gemms)
        self.in_features = _positive_int("in_features", in_features)
        self.out_features = _positive_int("out_features", out_features)
        factory = {"device": device, "dtype": params_dtype}
        self.weight = torch.nn.Parameter(torch.empty(num_gemms, out_features, in_features, **factory))
        self.bias = torch.nn.Parameter(torch.empty(num_gemms, out_features, **factory)) if bias else None
        for i in range(num_gemms):  # each expert initialised as a torch.nn.Linear of its own
            init_linear_parameters(self.weight.data[i], None if self.bias is None else self.bias.data[i])
        self.gemms = GroupedGemm(num_gemms, self.layer_types)

    @classmethod
    def sharing(cls, weight: torch.nn.Parameter, bias: torch.nn.Parameter | None, name: str) -> GroupedLinear:
        """A ``GroupedLinear`` whose Parameters are ``weight`` ``(num_gemms, out, in)`` and ``bias`` themselves
        (``convert`` shares a model's expert Parameters so that its optimizer keeps working on them)."""
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            raise LowprecValueError(f"weight must be a 3-D tensor (num_gemms, out_features, in_features), got {weight!r}")
        num_gemms, out_features, in_features = weight.shape
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (num_gemms, out_features)):
            raise LowprecValueError(f"bias must be None or of shape {(num_gemms, out_features)}, got {bias!r}")
        layer = cls(num_gemms, in_features, out_features, bias=bias is not None, name=name, device="meta")
        layer.weight = weight
        layer.bias = bias
        return layer

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if inp.shape[-1] != self.in_features:
            raise LowprecValueError(
                f"{self.name}: input's last dimension must be in_features={self.in_features}, got shape {tuple(inp.shape)}"
            )
        x = inp.reshape(-1, self.in_features)
        splits = check_m_splits(m_splits, self.num_gemms, x.shape[0])
        out = self.gemms.forward(self.name, x, self.weight, self.bias, splits, self.training)
        return out.reshape(*inp.shape[:-1], self.out_features)

    def debug_layers(self) -> list[tuple[str, tuple[str, ...]]]:
        """Its GEMMs, not the module itself, call the debug API."""
        return [(name, self.layer_types) for name in self.gemms.names(self.name)]

    def gemm_sizes(self) -> dict[str, int]:
        return dict.fromkeys(self.gemms.names(self.name), self.in_features * self.out_features)

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, " + super().extra_repr()
        )
