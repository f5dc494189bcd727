"""User-written transformer_engine features: every hook call reaches them with the documented arguments."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from debugrun import make_linear, section, train_step
from fp8ref import current_fake_quant

import lowprec
import nvdlfw_inspect.api as debug_api

FEATURES = """
import torch
from lowprec.debug.features.api import TEConfigAPIMapper
from lowprec.quant.protocol import Float8Tensor
from nvdlfw_inspect.registry import Registry, api_method

SEEN = []


@Registry.register_feature(namespace="transformer_engine")
class RecordPostquantize{tag}(TEConfigAPIMapper):
    uses_gemms = False

    @api_method
    def inspect_tensor_postquantize_enabled(self, config, layer_name, gemm, tensor_name, iteration):
        return True  # a bare bool: ask again next iteration

    @api_method
    def inspect_tensor_postquantize(self, config, layer_name, tensor_name, tensor, iteration, tp_group, rowwise):
        SEEN.append(("post", tensor_name, rowwise, type(tensor).__name__, iteration))


@Registry.register_feature(namespace="transformer_engine")
class OldStyleInspect{tag}(TEConfigAPIMapper):
    uses_gemms = False

    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        return True, iteration + 1

    @api_method
    def inspect_tensor(self, config, layer_name, tensor_name, tensor, iteration, tp_group):
        SEEN.append(("inspect", tensor_name, tuple(tensor.shape), iteration))


@Registry.register_feature(namespace="transformer_engine")
class DoubleOutput{tag}(TEConfigAPIMapper):
    @api_method
    def modify_tensor_enabled(self, config, layer_name, gemm, tensor_name, iteration):
        return True, iteration + 1

    @api_method
    def modify_tensor(self, config, layer_name, gemm, tensor_name, tensor, iteration, **kwargs):
        return tensor * 2 if tensor_name == "output" else tensor.clone()


@Registry.register_feature(namespace="transformer_engine")
class BadAnswer{tag}(TEConfigAPIMapper):
    uses_gemms = False

    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        return "yes"
"""


@pytest.fixture
def features(tmp_path, request):
    """A feature directory with fresh class names (modules stay imported between tests)."""
    tag = request.node.name.replace("[", "_").replace("]", "_").replace("-", "_")[-40:]
    directory = tmp_path / f"feat_{tag}"
    directory.mkdir()
    file = directory / f"custom_{tag}.py"
    file.write_text(textwrap.dedent(FEATURES.format(tag=tag)))

    def module():
        return next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(file))

    return directory, tag, module


def run(layer):
    return train_step(layer, torch.randn(4, 32), torch.randn(4, 24))


def test_postquantize_sees_fp8_operands_and_bool_answers_repeat(features, log_dir):
    directory, tag, module = features
    debug_api.initialize(
        config_file=section({f"RecordPostquantize{tag}": {"enabled": True, "tensors": ["activation", "gradient"]}}),
        feature_dirs=[directory],
        log_dir=log_dir,
    )
    layer = make_linear()
    for _ in range(2):
        run(layer)
        debug_api.step()
    seen = module().SEEN
    assert seen == [
        ("post", name, rowwise, "Float8Tensor", it)
        for it in (0, 1)
        for name in ("activation", "gradient")
        for rowwise in (True, False)
    ]


def test_old_inspect_signature_and_every_tensor(features, log_dir):
    directory, tag, module = features
    tensors = ["activation", "weight", "gradient", "output", "dgrad", "wgrad"]
    debug_api.initialize(
        config_file=section({f"OldStyleInspect{tag}": {"enabled": True, "tensors": tensors}}),
        feature_dirs=[directory],
        log_dir=log_dir,
    )
    run(make_linear())
    shapes = {name: shape for _, name, shape, _ in module().SEEN}
    assert shapes == {
        "activation": (4, 32),
        "weight": (24, 32),
        "output": (4, 24),
        "gradient": (4, 24),
        "dgrad": (4, 32),
        "wgrad": (24, 32),
    }


def test_modified_output_and_mixed_precision_operands(features, log_dir):
    """The activation comes back in high precision while the weight is FP8: the GEMM runs in high precision."""
    directory, tag, _ = features
    config = {f"DoubleOutput{tag}": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation", "output"]}}
    debug_api.initialize(config_file=section(config), feature_dirs=[directory], log_dir=log_dir)
    layer = make_linear()
    x = torch.randn(4, 32)
    with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
        y = layer(x)
    expected = 2 * (x @ current_fake_quant(layer.weight.detach()).t() + layer.bias.detach())
    assert torch.allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_malformed_answer_is_reported(features, log_dir):
    directory, tag, _ = features
    debug_api.initialize(
        config_file=section({f"BadAnswer{tag}": {"enabled": True, "tensors": ["activation"]}}),
        feature_dirs=[directory],
        log_dir=log_dir,
    )
    with pytest.raises(TypeError, match=r"inspect_tensor_enabled must return a bool or \(bool, next_iteration\), got 'yes'"):
        run(make_linear())
