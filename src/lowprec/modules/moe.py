"""Mixtures of experts in Hugging Face ``transformers``: the experts and the router as lowprec layers.

``transformers`` keeps a block's experts as fused 3-D Parameters (``gate_up_proj`` ``(E, 2 I, H)``,
``down_proj`` ``(E, H, I)``) applied in the experts module's own forward, and its router as a module
applying ``F.linear`` to its own ``weight``; neither is a ``torch.nn.Linear``. ``convert`` replaces them by
``GatedExperts`` and ``TopKRouter``, which share their Parameters (same names, so state dicts and the
optimizer stay as they are), compute what they computed, and run every GEMM through lowprec: each expert's
two GEMMs are the debug layers ``{experts}.gate_up_proj.gemm_{i}`` and ``{experts}.down_proj.gemm_{i}``,
the router is ``{router}``. Any other module holding a 3-D Parameter is reported by ``convert``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from lowprec.errors import LowprecValueError
from lowprec.modules.base import NamedModule
from lowprec.modules.grouped_gemm import GroupedGemm
from lowprec.modules.grouped_linear import GroupedLinear
from lowprec.modules.linear import GemmLayer
from lowprec.modules.replaceable import replacement_blocker

#: Hugging Face experts classes whose forward ``GatedExperts`` reproduces (the same code in each model)
HF_EXPERTS = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts")
#: Hugging Face router classes -> (always renormalise the top-k probabilities, return them in the logits' dtype);
#: None: renormalise as the router's ``norm_topk_prob`` says
HF_ROUTERS: dict[str, tuple[bool | None, bool]] = {
    "MixtralTopKRouter": (True, False),
    "Qwen2MoeTopKRouter": (None, True),
    "Qwen3MoeTopKRouter": (None, True),
}
#: the flags ``transformers.integrations.moe.use_experts_implementation`` sets, as ``GatedExperts`` computes
_EXPERTS_FLAGS = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_post_expert_norm": False,
    "_is_expert_parallel": False,
}


class GatedExperts(NamedModule):
    """``E`` gated MLP experts: token ``t`` routed to experts ``e`` with weights ``w`` gets
    ``sum_e w_e * down_e(act(gate_e(x_t)) * up_e(x_t))``, where ``gate_up_proj[e]`` ``(2 I, H)`` stacks
    ``gate_e`` over ``up_e`` and ``down_proj[e]`` is ``(H, I)`` (Hugging Face's ``MixtralExperts`` and its copies).

    ``forward(hidden_states, top_k_index, top_k_weights)`` as theirs: ``(tokens, H)``, the experts each token
    was routed to ``(tokens, k)`` and its routing weights. An expert that received no token runs no GEMM.
    ``sum_in_expert_order``: add each expert's contribution into the output in expert order (their "eager"
    implementation); otherwise each token's ``k`` contributions are summed at once (their "grouped_mm" and
    "batched_mm" ones, deterministic on every device).
    """

    layer_types = GroupedLinear.layer_types

    def __init__(
        self,
        gate_up_proj: torch.nn.Parameter,
        down_proj: torch.nn.Parameter,
        act_fn: torch.nn.Module,
        sum_in_expert_order: bool = False,
        name: str | None = None,
    ):
        super().__init__(name)
        if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
            raise LowprecValueError(
                f"gate_up_proj and down_proj must be 3-D, got {tuple(gate_up_proj.shape)}, {tuple(down_proj.shape)}"
            )
        experts, hidden, intermediate = down_proj.shape
        if tuple(gate_up_proj.shape) != (experts, 2 * intermediate, hidden):
            raise LowprecValueError(
                f"gate_up_proj must be (experts, 2 * intermediate, hidden) = {(experts, 2 * intermediate, hidden)} "
                f"for down_proj {tuple(down_proj.shape)}, got {tuple(gate_up_proj.shape)}"
            )
        self.num_experts, self.hidden_dim, self.intermediate_dim = experts, hidden, intermediate
        self.gate_up_proj, self.down_proj, self.act_fn = gate_up_proj, down_proj, act_fn
        self.sum_in_expert_order = sum_in_expert_order
        self.gate_up_gemms = GroupedGemm(experts, self.layer_types)
        self.down_gemms = GroupedGemm(experts, self.layer_types)

    @classmethod
    def from_hf(cls, module: torch.nn.Module, name: str) -> GatedExperts:
        """Sharing the Parameters and activation of a Hugging Face experts module, summing as its configured
        implementation (``config._experts_implementation``) does."""
        eager = getattr(getattr(module, "config", None), "_experts_implementation", None) == "eager"
        return cls(module.gate_up_proj, module.down_proj, module.act_fn, sum_in_expert_order=eager, name=name)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        with torch.no_grad():
            expert_ids = top_k_index.reshape(-1)  # (token, slot) pairs
            order = self._grouped_by_expert(top_k_index)
            counts = torch.bincount(expert_ids, minlength=self.num_experts)
        m_splits = counts.tolist()  # which rows each expert gets: read on the host, as every implementation does
        if len(m_splits) != self.num_experts:
            raise LowprecValueError(
                f"{self.name}: top_k_index must hold expert ids in [0, {self.num_experts}), got expert id {len(m_splits) - 1}"
            )
        token_idx = order // top_k
        h = self.gate_up_gemms.forward(
            f"{self.name}.gate_up_proj", hidden_states[token_idx], self.gate_up_proj, None, m_splits, self.training
        )
        gate, up = h.chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        h = self.down_gemms.forward(f"{self.name}.down_proj", h, self.down_proj, None, m_splits, self.training)
        h = h * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        if self.sum_in_expert_order:
            final = torch.zeros_like(hidden_states)
            for rows, idx in zip(h.split(m_splits), token_idx.split(m_splits), strict=True):
                if rows.shape[0]:
                    final.index_add_(0, idx, rows.to(final.dtype))
            return final
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return h[inverse].view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)

    def _grouped_by_expert(self, top_k_index: torch.Tensor) -> torch.Tensor:
        """The (token, slot) pairs (indices into ``top_k_index.reshape(-1)``) grouped by expert, in the order Hugging
        Face's implementation feeds each expert's GEMM its rows: a GEMM may round a row by its position in the
        matrix (MKL on AVX2 CPUs does), so bit-exactness needs the same order. "eager" takes an expert's rows slot by slot,
        token by token within a slot (its one-hot mask permuted to (expert, slot, token)); "grouped_mm" and
        "batched_mm" take them as ``torch.sort(expert_ids)`` (not stable) leaves them."""
        tokens, top_k = top_k_index.shape
        if not self.sum_in_expert_order:
            return torch.sort(top_k_index.reshape(-1)).indices
        slot_major = torch.sort(top_k_index.t().reshape(-1), stable=True).indices  # into (slot, token) pairs
        return (slot_major % tokens) * top_k + slot_major // tokens

    def debug_layers(self) -> list[tuple[str, tuple[str, ...]]]:
        """Its expert GEMMs, not the module itself, call the debug API."""
        names = self.gate_up_gemms.names(f"{self.name}.gate_up_proj") + self.down_gemms.names(f"{self.name}.down_proj")
        return [(name, self.layer_types) for name in names]

    def gemm_sizes(self) -> dict[str, int]:
        gate_up = dict.fromkeys(self.gate_up_gemms.names(f"{self.name}.gate_up_proj"), self.gate_up_proj[0].numel())
        return gate_up | dict.fromkeys(self.down_gemms.names(f"{self.name}.down_proj"), self.down_proj[0].numel())

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}, "
            + super().extra_repr()
        )


class TopKRouter(GemmLayer):
    """A mixture of experts' router: logits ``x W^T`` (``weight`` ``(num_experts, in_features)``, one lowprec
    GEMM), softmax in float32, the ``top_k`` largest probabilities, renormalised to sum to 1 if ``normalize``,
    cast back to the logits' dtype if ``scores_in_logits_dtype``. ``forward(x)`` returns ``(logits, scores,
    indices)`` as Hugging Face's ``MixtralTopKRouter`` and ``Qwen2MoeTopKRouter`` do. ``layer_types: [router]``
    selects it in debug configs.
    """

    layer_types = ("router",)

    def __init__(
        self,
        in_features: int,
        num_experts: int,
        top_k: int,
        normalize: bool = True,
        scores_in_logits_dtype: bool = False,
        name: str | None = None,
        device: torch.device | str | None = None,
        params_dtype: torch.dtype | None = None,
    ):
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise LowprecValueError(f"top_k must be an integer from 1 to num_experts={num_experts}, got {top_k!r}")
        super().__init__(in_features, num_experts, bias=False, name=name, device=device, params_dtype=params_dtype)
        self.num_experts, self.hidden_dim, self.top_k = num_experts, in_features, top_k  # Hugging Face's attribute names
        self.normalize, self.scores_in_logits_dtype = normalize, scores_in_logits_dtype

    @classmethod
    def from_hf(cls, module: torch.nn.Module, name: str, normalize: bool | None, scores_in_logits_dtype: bool) -> TopKRouter:
        """Sharing a Hugging Face router's ``weight``; ``normalize=None`` takes the router's ``norm_topk_prob``."""
        num_experts, in_features = module.weight.shape
        normalize = bool(module.norm_topk_prob) if normalize is None else normalize
        router = cls(in_features, num_experts, module.top_k, normalize, scores_in_logits_dtype, name=name, device="meta")
        router.weight = module.weight
        return router

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = super().forward(hidden_states.reshape(-1, self.in_features))
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        scores, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        if self.scores_in_logits_dtype:
            scores = scores.to(logits.dtype)
        return logits, scores, indices

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, normalize={self.normalize}, " + super().extra_repr()


def moe_plan(module: torch.nn.Module) -> Callable[[str], NamedModule] | str | None:
    """``convert``'s plan for a module of a mixture of experts: a factory taking the layer name (Hugging Face
    experts and routers ``GatedExperts`` and ``TopKRouter`` reproduce), the reason one stays as it is (those
    modules in a form they do not reproduce, and any other module holding a 3-D Parameter, whose GEMMs
    would run unseen in high precision), or None."""
    experts = _hf_class(module, HF_EXPERTS)
    if experts is not None:
        return _experts_blocker(module, experts) or partial(GatedExperts.from_hf, module)
    router = _hf_class(module, tuple(HF_ROUTERS))
    if router is not None:
        normalize, scores_in_logits_dtype = HF_ROUTERS[router.__name__]
        factory = partial(TopKRouter.from_hf, module, normalize=normalize, scores_in_logits_dtype=scores_in_logits_dtype)
        return _router_blocker(module, router) or factory
    stacked = [f"{name} {tuple(p.shape)}" for name, p in module.named_parameters(recurse=False) if p.dim() == 3]
    if stacked:
        return (
            f"holds 3-D weights ({', '.join(stacked)}), stacked expert weights applied in its own forward; lowprec "
            f"converts the experts of {', '.join(HF_EXPERTS)}, so these GEMMs stay in high precision"
        )
    return None


def _hf_class(module: torch.nn.Module, names: tuple[str, ...]) -> type | None:
    """The ``transformers`` class named in ``names`` that ``module`` is an instance of (found without importing it)."""
    for cls in type(module).__mro__:
        if cls.__name__ in names and cls.__module__.startswith("transformers."):
            return cls
    return None


def _computes(cls: type) -> str:
    return f" (the converted layer computes {cls.__name__}'s)"


def _experts_blocker(module: torch.nn.Module, cls: type) -> str | None:
    reason = replacement_blocker(module, cls.forward, ("gate_up_proj", "down_proj", "act_fn"), override_hint=_computes(cls))
    if reason is not None:
        return reason
    changed = [
        f"{flag}={getattr(module, flag, None)!r}"
        for flag, value in _EXPERTS_FLAGS.items()
        if getattr(module, flag, None) != value
    ]
    if changed:
        return (
            f"experts with {', '.join(changed)}: lowprec converts gated, concatenated, untransposed experts "
            "without bias or expert parallelism"
        )
    if getattr(getattr(type(module), "_apply_gate", None), "__name__", None) != "_default_apply_gate":
        return f"{type(module).__name__} defines its own _apply_gate, which the converted experts would not run"
    return None


def _router_blocker(module: torch.nn.Module, cls: type) -> str | None:
    reason = replacement_blocker(module, cls.forward, ("weight",), override_hint=_computes(cls))
    if reason is None and module.weight.dim() != 2:
        reason = f"its weight is {tuple(module.weight.shape)}, not (num_experts, hidden)"
    return reason
