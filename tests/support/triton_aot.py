"""Compile a Triton kernel for a Hopper GPU (sm_90) on a machine without one: Triton's front end,
its optimizer and ``ptxas`` all run on the CPU, so kernel code the interpreter accepts but the real
compiler rejects fails here, and the PTX can be checked."""

from __future__ import annotations

from typing import Any


def hopper_ptx(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], options: dict[str, Any]) -> str:
    """The PTX of ``kernel`` for sm_90, with ``signature`` giving each argument's type (``"*bf16"``,
    ``"i32"``, ``"constexpr"``), ``constexprs`` the compile-time values and ``options`` those the
    kernel is launched with."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
