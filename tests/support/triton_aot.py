"""Compile a Triton kernel for a Hopper GPU (sm_90) on a machine without one: Triton's front end,
its optimizer and ``ptxas`` all run on the CPU, so kernel code the interpreter accepts but the real
compiler rejects fails here, and the PTX can be checked."""

from __future__ import annotations

from typing import Any


def hopper_ptx(
    kernel: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    options: dict[str, Any],
    launch_ints: dict[str, int] | None = None,
) -> str:
    """The PTX of ``kernel`` for sm_90, with ``signature`` giving each argument's type (``"*bf16"``,
    ``"i32"``, ``"constexpr"``), ``constexprs`` the compile-time values and ``options`` those the
    kernel is launched with. ``launch_ints``: integer arguments' values, specialized as a launch on a GPU
    specializes them (each pointer taken 16-byte aligned): the interpreter never does, and an H200 found a
    kernel that compiled only for some values."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = dict(signature), dict(constexprs), {}
    if launch_ints is not None:
        exempt = set(kernel.do_not_specialize)
        for index, name in enumerate(kernel.arg_names):
            if signature.get(name, "").startswith("*"):
                attrs[(index,)] = [["tt.divisibility", 16]]
            elif name in launch_ints and name not in exempt:
                value = launch_ints[name]
                if value == 1:
                    signature[name], constexprs[name] = "constexpr", 1
                elif value % 16 == 0:
                    attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
