"""``lowprec.convert``: make any PyTorch model's linear layers FP8-capable and debuggable."""

from __future__ import annotations

import torch

from lowprec.modules.linear import Linear


def convert(model: torch.nn.Module, prefix: str = "model") -> torch.nn.Module:
    """Replace every ``torch.nn.Linear`` inside ``model`` with a ``lowprec.Linear`` sharing its parameters.

    Each new layer is named by its module path (``{prefix}.encoder.layer.0.attention.query``), which is
    what debug configs select. Returns ``model`` (changed in place); a bare ``torch.nn.Linear`` is returned
    converted.
    """
    if type(model) is torch.nn.Linear:
        return Linear.from_torch(model, prefix)
    for path, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                full = ".".join(part for part in (prefix, path, child_name) if part)
                setattr(module, child_name, Linear.from_torch(child, full))
    return model
