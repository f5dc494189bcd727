"""A mixed precision plan on a CUDA device: the per-tensor FP8 layers run ``torch._scaled_mm`` on FP8 tensor cores, the
block formats (no lowprec kernel) are emulated and said once; the numbers agree with the CPU emulation."""

from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec import gemm as gemm_module
from lowprec.gemm import ACCUMULATION_BOUND

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
PLAN = {
    "rules": [
        {"layers": {"exact_layer_names": ["model.mx"]}, "recipe": "mxfp8"},
        {"layers": {"exact_layer_names": ["model.fp4"]}, "recipe": {"name": "nvfp4", "disable_stochastic_rounding": True}},
    ]
}


def model_on(device: str) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(lowprec.Linear(128, 128, name=f"model.{n}") for n in ("fp8", "mx", "fp4"))).to(device)


def run(device: str) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Each layer's (input, output) on the host, and the weight gradients."""
    model = model_on(device)
    x = torch.randn(64, 128).to(device).requires_grad_()  # the same x on both; a gradient: the FP8 layer's dgrad runs
    seen = []
    for layer in model:
        layer.register_forward_hook(lambda _, args, out: seen.append((args[0].detach().cpu(), out.detach().cpu())))
    with lowprec.autocast(recipe=lowprec.Float8CurrentScaling(), plan=PLAN):
        out = model(x)
    out.sum().backward()
    return seen, [p.grad.cpu() for p in model.parameters() if p.dim() == 2]


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.skipif(not HOPPER, reason="needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+)")
def test_a_mixed_plan_runs_fp8_on_tensor_cores_and_says_where_it_emulates(monkeypatch):
    calls = []
    original = gemm_module._scaled_mm
    monkeypatch.setattr(gemm_module, "_scaled_mm", lambda a, b, dtype: calls.append(a.shape) or original(a, b, dtype))
    with pytest.warns(RuntimeWarning, match=r"block-scaled GEMM \(FP8E4M3 elements\) emulated on cuda") as caught:
        cuda_layers, cuda_grads = run("cuda")
    assert any("E2M1" in str(w.message) for w in caught)  # NVFP4's GEMMs said too
    assert len(calls) == 3  # the FP8 layer's fprop, dgrad and wgrad (E4M3 x E5M2 in the backward)
    # Layer by layer on the same input: the casts are bit for bit, so the outputs differ by the GEMMs' summation
    # alone (through three layers, a sum's last bit can move a value across a rounding of the next layer's cast).
    cpu_model = model_on("cpu")
    for layer, (cuda_in, cuda_out) in zip(cpu_model, cuda_layers, strict=True):
        with lowprec.autocast(recipe=lowprec.Float8CurrentScaling(), plan=PLAN):
            cpu_out = layer(cuda_in).detach()
        bound = float(cpu_out.abs().max()) * 64 * ACCUMULATION_BOUND
        assert torch.allclose(cuda_out, cpu_out, rtol=0, atol=bound), layer.name
    _, cpu_grads = run("cpu")
    for cuda_grad, cpu_grad in zip(cuda_grads, cpu_grads, strict=True):
        assert relative_difference(cuda_grad, cpu_grad) < 0.1  # flips downstream: ~2% for a 1e-4 relative perturbation
