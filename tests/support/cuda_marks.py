"""Which tests need CUDA: tests/conftest.py marks them ``cuda`` (scripts/gpu_check.sh runs ``-m cuda``), and
the test of the GPU check's CPU plan collects only the files that can hold them."""

from __future__ import annotations

import re
from pathlib import Path

# A skipif reason naming the device marks a test that needs CUDA.
CUDA_SKIP_REASON = re.compile(r"CUDA|GPU|FP8 tensor cores")


def files_with_cuda_tests(tests: Path) -> list[str]:
    """The test files under ``tests`` that can hold a ``cuda`` test: a skip reason naming the device, or the
    marker itself (on a test that skips at run time)."""
    holds_cuda = re.compile(rf"""reason=["'][^"'\n]*({CUDA_SKIP_REASON.pattern})|mark\.cuda\b""")
    return sorted(str(path) for path in tests.rglob("test_*.py") if holds_cuda.search(path.read_text()))
