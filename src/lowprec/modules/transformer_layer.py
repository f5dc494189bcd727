"""``lowprec.TransformerLayer``: pre-norm self-attention and MLP blocks built from lowprec layers.

Debug layer names under ``TransformerLayer(name=N)``: ``N.self_attention.layernorm_qkv`` (the fused
norm and QKV projection, a ``LayerNormLinear``), ``N.self_attention.proj`` (a ``Linear``),
``N.layernorm_mlp.fc1`` and ``N.layernorm_mlp.fc2``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowprec.errors import LowprecValueError
from lowprec.modules.base import NamedModule
from lowprec.modules.layernorm_linear import LayerNormLinear
from lowprec.modules.layernorm_mlp import LayerNormMLP
from lowprec.modules.linear import Linear

INPUT_FORMATS = ("sbhd", "bshd")
MASK_TYPES = ("causal", "no_mask")


class SelfAttention(NamedModule):
    """Norm and QKV projection, scaled-dot-product attention over ``num_attention_heads``, output projection."""

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        *,
        bias: bool,
        normalization: str,
        eps: float,
        attention_dropout: float,
        mask_type: str,
        input_format: str,
        name: str | None,
        device: torch.device | str | None,
        params_dtype: torch.dtype | None,
    ):
        super().__init__(name)
        if hidden_size % num_attention_heads:
            raise LowprecValueError(
                f"hidden_size ({hidden_size}) must be a multiple of num_attention_heads ({num_attention_heads})"
            )
        self.heads, self.attention_dropout = num_attention_heads, attention_dropout
        self.causal, self.input_format = mask_type == "causal", input_format
        factory = {"device": device, "params_dtype": params_dtype}
        self.layernorm_qkv = LayerNormLinear(
            hidden_size, 3 * hidden_size, bias=bias, normalization=normalization, eps=eps, **factory
        )
        self.proj = Linear(hidden_size, hidden_size, bias=bias, **factory)
        self._name_children(self.name)

    def _name_children(self, name: str) -> None:
        self.layernorm_qkv.name = f"{name}.layernorm_qkv"
        self.proj.name = f"{name}.proj"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_format == "sbhd":
            x = x.transpose(0, 1)  # attention below works batch-first
        batch, seq, hidden = x.shape
        qkv = self.layernorm_qkv(x).reshape(batch, seq, 3, self.heads, hidden // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [batch, heads, seq, head_dim]
        dropout = self.attention_dropout if self.training else 0.0
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=self.causal)
        out = self.proj(context.transpose(1, 2).reshape(batch, seq, hidden))
        return out.transpose(0, 1) if self.input_format == "sbhd" else out


class TransformerLayer(NamedModule):
    """``x + attn(x)`` then ``h + mlp(h)``, each branch with dropout ``hidden_dropout``.

    Inputs are ``[seq, batch, hidden]`` (``attn_input_format="sbhd"``, the default) or
    ``[batch, seq, hidden]`` (``"bshd"``). ``self_attn_mask_type`` is ``"causal"`` or ``"no_mask"``.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        bias: bool = True,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        self_attn_mask_type: str = "causal",
        attn_input_format: str = "sbhd",
        name: str | None = None,
        device: torch.device | str | None = None,
        params_dtype: torch.dtype | None = None,
    ):
        super().__init__(name)
        if attn_input_format not in INPUT_FORMATS:
            raise LowprecValueError(f"attn_input_format must be one of {list(INPUT_FORMATS)}, got {attn_input_format!r}")
        if self_attn_mask_type not in MASK_TYPES:
            raise LowprecValueError(f"self_attn_mask_type must be one of {list(MASK_TYPES)}, got {self_attn_mask_type!r}")
        self.hidden_dropout = hidden_dropout
        self.self_attention = SelfAttention(
            hidden_size,
            num_attention_heads,
            bias=bias,
            normalization=normalization,
            eps=layernorm_epsilon,
            attention_dropout=attention_dropout,
            mask_type=self_attn_mask_type,
            input_format=attn_input_format,
            name=None,
            device=device,
            params_dtype=params_dtype,
        )
        self.layernorm_mlp = LayerNormMLP(
            hidden_size,
            ffn_hidden_size,
            bias=bias,
            normalization=normalization,
            eps=layernorm_epsilon,
            activation=activation,
            device=device,
            params_dtype=params_dtype,
        )
        self._name_children(self.name)

    def _name_children(self, name: str) -> None:
        self.self_attention.name = f"{name}.self_attention"
        self.layernorm_mlp.name = f"{name}.layernorm_mlp"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + F.dropout(self.self_attention(x), self.hidden_dropout, self.training)
        return h + F.dropout(self.layernorm_mlp(h), self.hidden_dropout, self.training)
