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


def run(device: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(lowprec.Linear(128, 128, name=f"model.{n}") for n in ("fp8", "mx", "fp4"))).to(device)
    x = torch.randn(64, 128, device=device)
    with lowprec.autocast(recipe=lowprec.Float8CurrentScaling(), plan=PLAN):
        out = model(x)
    out.sum().backward()
    return out.detach().cpu(), [p.grad.cpu() for p in model.parameters() if p.dim() == 2]


@pytest.mark.skipif(not HOPPER, reason="needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+)")
def test_a_mixed_plan_runs_fp8_on_tensor_cores_and_says_where_it_emulates(monkeypatch):
    calls = []
    original = gemm_module._scaled_mm
    monkeypatch.setattr(gemm_module, "_scaled_mm", lambda a, b, dtype: calls.append(a.shape) or original(a, b, dtype))
    with pytest.warns(RuntimeWarning, match=r"block-scaled GEMM \(FP8E4M3 elements\) emulated on cuda") as caught:
        cuda_out, cuda_grads = run("cuda")
    assert any("E2M1" in str(w.message) for w in caught)  # NVFP4's GEMMs said too
    assert len(calls) == 3  # the FP8 layer's fprop, dgrad and wgrad (E4M3 x E5M2 in the backward)
    cpu_out, cpu_grads = run("cpu")
    scale = cpu_out.abs().max()
    assert torch.allclose(cuda_out, cpu_out, rtol=0, atol=float(scale) * 64 * ACCUMULATION_BOUND)
    for cuda_grad, cpu_grad in zip(cuda_grads, cpu_grads, strict=True):
        assert torch.allclose(cuda_grad, cpu_grad, rtol=1e-2, atol=float(cpu_grad.abs().max()) * 1e-2)
