"""``lowprec.LayerNormMLP``: norm, ``fc1``, activation, ``fc2``; each of the two GEMM layers is a debug layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowprec.errors import LowprecValueError
from lowprec.modules.base import NamedModule
from lowprec.modules.gemm_unit import GemmUnit
from lowprec.modules.linear import init_linear_parameters
from lowprec.modules.norm import Norm


def _gelu(x: torch.Tensor) -> torch.Tensor:
    """Transformer Engine's GELU (tanh approximation); a named function, so a pickled layer finds it by name."""
    return F.gelu(x, approximate="tanh")


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _geglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _reglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.relu(gate) * up


#: activation name -> (function, how many times ffn_hidden_size fc1 produces)
ACTIVATIONS = {
    "gelu": (_gelu, 1),
    "relu": (F.relu, 1),
    "silu": (F.silu, 1),
    "swiglu": (_swiglu, 2),
    "geglu": (_geglu, 2),
    "reglu": (_reglu, 2),
}


class LayerNormMLP(NamedModule):
    """``fc2(act(fc1(norm(x))))`` with ``fc1: hidden -> ffn_hidden`` (twice that for gated activations)
    and ``fc2: ffn_hidden -> hidden``.

    The two GEMM layers are debugged as ``{name}.fc1`` and ``{name}.fc2``; ``layer_types: [fc1]`` picks
    the first by name, ``layer_types: [layernorm_mlp]`` both. The activation runs in high precision.
    """

    layer_types = ("layernorm_mlp",)

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        normalization: str = "LayerNorm",
        eps: float = 1e-5,
        activation: str = "gelu",
        name: str | None = None,
        device: torch.device | str | None = None,
        params_dtype: torch.dtype | None = None,
    ):
        super().__init__(name)
        if activation not in ACTIVATIONS:
            raise LowprecValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        self._activation, widen = ACTIVATIONS[activation]
        factory = {"device": device, "dtype": params_dtype}
        self.norm = Norm(hidden_size, normalization, eps, **factory)
        self.fc1_weight = torch.nn.Parameter(torch.empty(widen * ffn_hidden_size, hidden_size, **factory))
        self.fc1_bias = torch.nn.Parameter(torch.empty(widen * ffn_hidden_size, **factory)) if bias else None
        self.fc2_weight = torch.nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, **factory))
        self.fc2_bias = torch.nn.Parameter(torch.empty(hidden_size, **factory)) if bias else None
        init_linear_parameters(self.fc1_weight, self.fc1_bias)
        init_linear_parameters(self.fc2_weight, self.fc2_bias)
        self.fc1_unit = GemmUnit(self.layer_types)
        self.fc2_unit = GemmUnit(self.layer_types)

    def debug_layers(self) -> list[tuple[str, tuple[str, ...]]]:
        """Its two GEMM layers, not the module itself, call the debug API."""
        return [(f"{self.name}.{gemm}", self.layer_types) for gemm in ("fc1", "fc2")]

    def gemm_sizes(self) -> dict[str, int]:
        return {f"{self.name}.fc1": self.fc1_weight.numel(), f"{self.name}.fc2": self.fc2_weight.numel()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1_unit.linear(f"{self.name}.fc1", self.norm(x), self.fc1_weight, self.fc1_bias, self.training)
        return self.fc2_unit.linear(f"{self.name}.fc2", self._activation(hidden), self.fc2_weight, self.fc2_bias, self.training)
