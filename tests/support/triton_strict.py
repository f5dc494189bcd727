"""Triton's interpreter made as strict as the one of Triton 3.6, for the kernel checks that run in it."""

from __future__ import annotations


def index_as_triton_36() -> None:
    """Make ``int(tensor)`` in the interpreter as strict as Triton 3.6's (``int`` of a 1-element array,
    which recent NumPy refuses; 3.9 squeezes it first): a ``range`` bound that is a tensor (a kernel
    argument, ``program_id``) then fails with any Triton, as it did with 3.6 on the GPU machine."""
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None:
        return

    def strict(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    interpreter._patch_lang_tensor = strict
