"""A validation under ``torch.inference_mode()`` between training steps (Lightning's default) leaves the layers
able to train on, under every recipe, with or without debugging: the state a recipe keeps between forwards (delayed
scaling's amax history and scales) stays made of normal tensors, so training goes on exactly as after a validation
under ``torch.no_grad()``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest
import torch

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.recipe import RECIPES

STATS = {"enabled": True, "tensors": ["activation", "gradient"], "stats": ["max", "l1_norm"]}
CONFIG = {"all": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": {"LogTensorStats": STATS}}}


def train_around_a_validation(recipe: lowprec.Recipe, validation: Callable[[], AbstractContextManager]) -> list[torch.Tensor]:
    """Three training steps with a validation forward (the model in eval mode, under ``validation()``) before the
    second; every training output and parameter along the way."""
    torch.manual_seed(0)
    model = lowprec.convert(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    results = []
    for step in range(3):
        x = torch.randn(16, 32, generator=generator)
        if step == 1:
            model.eval()
            with validation(), lowprec.autocast(recipe=recipe):
                model(x)
            model.train()
        with lowprec.autocast(recipe=recipe):
            y = model(x)
        y.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        debug_api.step()
        results += [y.detach(), *(p.detach().clone() for p in model.parameters())]
    return results


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debugged"])
@pytest.mark.parametrize("recipe", [cls() for cls in RECIPES], ids=[cls.__name__ for cls in RECIPES])
def test_training_goes_on_after_an_inference_mode_validation_as_after_a_no_grad_one(recipe, debug, log_dir):
    if debug:
        debug_api.initialize(config_file=CONFIG, feature_dirs=[lowprec.FEATURE_DIR], log_dir=log_dir)
    after_inference_mode = train_around_a_validation(recipe, torch.inference_mode)
    after_no_grad = train_around_a_validation(recipe, torch.no_grad)
    for a, b in zip(after_inference_mode, after_no_grad, strict=True):
        assert torch.equal(a, b)
