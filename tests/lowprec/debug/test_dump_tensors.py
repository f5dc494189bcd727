"""DumpTensors: which iterations and tensors it saves, where, and that the files hold plain tensors equal to
the layer's high-precision tensors and quantized operands, readable without lowprec."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from blockref import mx_fake
from debugrun import make_linear, section, start, train_step

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.debug.features.dump_tensors import dump_file_name
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
    names = sorted(p.name for p in (root / "iter_000002").iterdir())
    assert names == sorted(dump_file_name("model.fc1", t) for t in TENSORS)
    assert all(name.startswith("model_fc1_") for name in names)
    activation = torch.load(root / "iter_000002" / dump_file_name("model.fc1", "activation"), weights_only=True)
    assert torch.equal(activation["high_precision"], X)
    quantized = activation["quantized"]
    assert quantized["format"] == "FP8E4M3" and quantized["data"].dtype == torch.float8_e4m3fn
    expected = CurrentScalingQuantizer(E4M3).quantize(X).dequantize(torch.float32)
    assert torch.equal(quantized["data"].float() * quantized["scale_inv"], expected)
    weight = torch.load(root / "iter_000002" / dump_file_name("model.fc1", "weight"), weights_only=True)
    assert torch.equal(weight["high_precision"], layer.weight.detach() - 0.01)  # the weight of step 2, not 3
    output = torch.load(root / "iter_000002" / dump_file_name("model.fc1", "output"), weights_only=True)
    assert list(output) == ["high_precision"]


def test_mxfp8_operand_as_plain_tensors_loads_without_lowprec(log_dir):
    dump_run(log_dir, lowprec.MXFP8BlockScaling(), steps=1)
    path = log_dir / "tensor_dumps" / "rank_0" / "iter_000000" / dump_file_name("model.fc1", "activation")
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


def dump_activations(log_dir, names: list[str], steps: int = 1) -> dict[str, torch.Tensor]:
    """Each layer its own input, dumped at every step; returns the inputs by layer name."""
    config = {"enabled": True, "tensors": ["activation"], "high_precision_tensor": True}
    start(section({"DumpTensors": config}), log_dir)
    inputs = {name: torch.randn(16, 64) for name in names}
    layers = {name: make_linear(name=name, in_f=64, out_f=48) for name in names}
    for _ in range(steps):
        for name in names:
            train_step(layers[name], inputs[name], DY, recipe=lowprec.Float8CurrentScaling())
        debug_api.step()
    debug_api.end_debug()
    return inputs


def test_file_names_are_safe_bounded_and_unique(log_dir):
    names = ["model.fc1", "model_fc1", "x" * 300, "a\0b", "a/../../b", "ü" * 200]
    inputs = dump_activations(log_dir, names)
    directory = log_dir / "tensor_dumps" / "rank_0" / "iter_000000"
    # model.fc1 gets Transformer Engine's name; model_fc1, dumped next in the same iteration, would clash with it
    files = {dump_file_name(name, "activation", clash=name == "model_fc1"): name for name in names}
    assert len(files) == len(names) and sorted(p.name for p in directory.iterdir()) == sorted(files)
    assert dump_file_name("model.fc1", "activation") == "model_fc1_activation.pt"  # as TE names it
    assert dump_file_name("a/../../b", "activation") == "a_______b_activation.pt"
    for file, name in files.items():
        assert len(file.encode()) <= 255 and "\0" not in file and "/" not in file
        assert torch.equal(torch.load(directory / file, weights_only=True)["high_precision"], inputs[name])


def test_a_real_full_disk_costs_only_the_dumps_that_do_not_fit(small_tmpfs):
    """On a full tmpfs ``torch.save`` reported the failed write as a ``RuntimeError`` ("unexpected pos"), which
    reached the training step. Now: no step raises, the cause is said once, no partial or temporary file is left,
    and dumps are written again once there is space."""
    disk = small_tmpfs("256k")
    log_dir, filler = disk / "logs", disk / "filler"
    filler.write_bytes(bytes(128 * 1024))
    config = {"enabled": True, "tensors": TENSORS, "high_precision_tensor": True, "quantized_tensor": True}
    start(section({"DumpTensors": config}), log_dir)
    fc1, fc2 = make_linear(name="model.fc1", in_f=128, out_f=96), make_linear(name="model.fc2", in_f=96, out_f=64)
    model, x, dy = torch.nn.Sequential(fc1, fc2), torch.randn(16, 128), torch.randn(16, 64)
    said = f"DumpTensors cannot write tensor dumps in {re.escape(str(log_dir))}.*No space left on device"
    with pytest.warns(UserWarning, match=said) as record:
        for step in range(12):
            if step == 6:
                filler.unlink()  # space again: the next dumps are written
            with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
                y = model(x)
            y.backward(dy)
            debug_api.step()
        debug_api.end_debug()
    assert sum("DumpTensors cannot write" in str(w.message) for w in record) == 1
    files = [p for p in (log_dir / "tensor_dumps").rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix != ".pt" or p.name.startswith(".")]  # no temporary file left
    iterations = {p.parent.name for p in files}
    assert "iter_000000" in iterations and iterations & {"iter_000006", "iter_000007"}  # before the disk filled, after
    assert len(files) < 12 * 2 * len(TENSORS)  # some did not fit
    for path in files:  # every file there is a whole dump
        dump = torch.load(path, weights_only=True)
        if path.name.endswith("fc1_activation.pt"):
            assert torch.equal(dump["high_precision"], x)


def test_dumps_never_follow_links_out_of_log_dir(log_dir, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.pt"
    victim.write_bytes(b"precious")
    iteration = log_dir / "tensor_dumps" / "rank_0" / "iter_000000"
    iteration.mkdir(parents=True)
    (iteration / dump_file_name("model.fc1", "activation")).symlink_to(victim)  # replaced, not followed
    (log_dir / "tensor_dumps" / "rank_0" / "iter_000001").symlink_to(outside)  # refused: the dump is skipped
    with pytest.warns(UserWarning, match=r"symbolic link .*iter_000001 -> .*outside leads out of log_dir"):
        inputs = dump_activations(log_dir, ["model.fc1"], steps=2)
    assert victim.read_bytes() == b"precious" and sorted(p.name for p in outside.iterdir()) == ["victim.pt"]
    dump = iteration / dump_file_name("model.fc1", "activation")
    assert not dump.is_symlink() and torch.equal(torch.load(dump, weights_only=True)["high_precision"], inputs["model.fc1"])


def test_relative_log_dir_and_a_later_chdir_keep_dumps_in_log_dir(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    config = {"enabled": True, "tensors": ["activation"], "high_precision_tensor": True}
    start(section({"DumpTensors": config}), "logs")
    layer = make_linear(name="fc1", in_f=64, out_f=48)
    monkeypatch.chdir(tmp_path / "b")
    train_step(layer, X, DY, recipe=lowprec.Float8CurrentScaling())
    debug_api.end_debug()
    assert (tmp_path / "a" / "logs" / "tensor_dumps" / "rank_0" / "iter_000000" / "fc1_activation.pt").is_file()
    assert list((tmp_path / "b").iterdir()) == []
