"""DumpTensors: which iterations and tensors it saves, where, and that the files hold plain tensors equal to
the layer's high-precision tensors and quantized operands, readable without lowprec."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from blockref import mx_fake
from debugrun import make_linear, section, start, train_step

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.formats.elements import E4M3
from lowprec.quant.per_tensor import CurrentScalingQuantizer
from nvdlfw_inspect.errors import ConfigError

X, DY = torch.randn(16, 64), torch.randn(16, 48)
TENSORS = ["activation", "weight", "gradient", "output"]


def dump_run(log_dir, recipe, steps: int = 4, **options) -> lowprec.Linear:
    config = {"enabled": True, "tensors": TENSORS, "high_precision_tensor": True, "quantized_tensor": True, **options}
    start(section({"DumpTensors": config}, layers={"layer_name_regex_pattern": ".*"}), log_dir)
    layer = make_linear(name="model.fc1", in_f=64, out_f=48)
    for _ in range(steps):
        with torch.no_grad():
            layer.weight.add_(0.01)  # every step a new weight
        train_step(layer, X, DY, recipe=recipe)
        debug_api.step()
    debug_api.end_debug()
    return layer


def test_schedule_paths_and_contents_under_current_scaling(log_dir):
    layer = dump_run(log_dir, lowprec.Float8CurrentScaling(), freq=2, start_step=0, end_step=2)
    root = log_dir / "tensor_dumps" / "rank_0"
    assert sorted(p.name for p in root.iterdir()) == ["iter_000000", "iter_000002"]
    assert sorted(p.name for p in (root / "iter_000002").iterdir()) == [f"model_fc1_{t}.pt" for t in sorted(TENSORS)]
    activation = torch.load(root / "iter_000002" / "model_fc1_activation.pt", weights_only=True)
    assert torch.equal(activation["high_precision"], X)
    quantized = activation["quantized"]
    assert quantized["format"] == "FP8E4M3" and quantized["data"].dtype == torch.float8_e4m3fn
    expected = CurrentScalingQuantizer(E4M3).quantize(X).dequantize(torch.float32)
    assert torch.equal(quantized["data"].float() * quantized["scale_inv"], expected)
    weight = torch.load(root / "iter_000002" / "model_fc1_weight.pt", weights_only=True)
    assert torch.equal(weight["high_precision"], layer.weight.detach() - 0.01)  # the weight of step 2, not 3
    assert list(torch.load(root / "iter_000002" / "model_fc1_output.pt", weights_only=True)) == ["high_precision"]


def test_mxfp8_operand_as_plain_tensors_loads_without_lowprec(log_dir):
    dump_run(log_dir, lowprec.MXFP8BlockScaling(), steps=1)
    path = log_dir / "tensor_dumps" / "rank_0" / "iter_000000" / "model_fc1_activation.pt"
    quantized = torch.load(path, weights_only=True)["quantized"]
    rowwise = quantized["rowwise"]
    assert quantized["format"] == "block_scaled_FP8E4M3" and rowwise["block"] == (1, 32) and rowwise["shape"] == (16, 64)
    values = rowwise["data"].float().reshape(16, 2, 32) * rowwise["scales"].float()[:, :, None]
    assert torch.equal(values.reshape(16, 64), mx_fake(X, E4M3))
    assert quantized["columnwise"]["shape"] == (64, 16)
    script = f"import sys; sys.modules['lowprec'] = None; import torch; d = torch.load({str(path)!r}); print(sorted(d))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "['high_precision', 'quantized']"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"high_precision_tensor": False}, r"DumpTensors dumps nothing"),
        ({"high_precision_tensor": "yes"}, r"high_precision_tensor'.*must be True or False"),
        ({"high_precision_tensor": True, "freq": 0}, r"freq"),
    ],
)
def test_config_errors(log_dir, options, message):
    with pytest.raises(ConfigError, match=message):
        start(section({"DumpTensors": {"enabled": True, "tensors": ["activation"], **options}}), log_dir)
