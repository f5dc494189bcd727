"""``lowprec.set_kernel_mode``: the one setting that says whether the fused kernels run."""

import pytest
import torch

import lowprec
from lowprec import kernels


class CudaLike:
    """What ``runs_on`` reads of a 2-D CUDA tensor, on a machine without one."""

    is_cuda, device = True, torch.device("cpu")

    def dim(self) -> int:
        return 2


def test_emulated_mode_keeps_every_tensor_off_the_kernels_and_auto_comes_back(monkeypatch):
    monkeypatch.setattr(kernels, "_triton_installed", lambda: True)
    monkeypatch.setattr(kernels, "_has_fp8_conversions", lambda device: True)
    cuda_like = CudaLike()
    assert lowprec.kernel_mode() == "auto" and kernels.runs_on(cuda_like)
    previous = lowprec.set_kernel_mode("emulated")
    try:
        assert previous == "auto" and lowprec.kernel_mode() == "emulated" and not kernels.runs_on(cuda_like)
    finally:
        lowprec.set_kernel_mode(previous)
    assert kernels.runs_on(cuda_like)


def test_a_mode_that_is_not_one_names_the_allowed_ones():
    with pytest.raises(
        lowprec.errors.LowprecValueError, match="lowprec kernel mode must be one of 'auto', 'emulated'; got 'off'"
    ):
        lowprec.set_kernel_mode("off")
    assert lowprec.kernel_mode() == "auto"
