"""A tensor the statistics cannot read (meta, sparse, complex, quantized, nested, a subclass with its own
dispatch) is skipped with one warning naming its layer, its name and why; every other layer and step is
still logged, and the run, a lowprec training loop included, finishes. Integer and bool tensors are read,
converted to float64."""

from __future__ import annotations

import math
import warnings
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from logreader import read_messages

import lowprec
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.logging import BaseLogger
from nvdlfw_inspect.stats import compute_partials

STATS = ["min", "max", "mean", "std", "l1_norm", "l2_norm"]
STEPS = 3


class Collect(BaseLogger):
    def __init__(self) -> None:
        self.values: dict[tuple[str, int], float] = {}

    def log_scalar(self, name: str, value: float, iteration: int) -> None:
        self.values[(name, iteration)] = value


class OpaqueTensor(torch.Tensor):
    """A wrapper subclass with its own dispatch that knows no operator but detach, like a sharded or
    quantized tensor type of another library."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...]) -> OpaqueTensor:
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return OpaqueTensor(tuple(args[0].shape))
        raise NotImplementedError(f"{func} is not supported by OpaqueTensor")


def unreadable() -> dict[str, tuple[torch.Tensor, str]]:
    """Tensors the statistics cannot read, each with the words its warning must contain."""
    dense = torch.randn(4, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes that these layouts are beta or deprecated
        sparse_csr, nested = dense.to_sparse_csr(), torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
        quantized = torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8)
    return {
        "meta": (torch.empty(10, device="meta"), "meta device"),
        "sparse_coo": (dense.to_sparse(), "layout is torch.sparse_coo"),
        "sparse_csr": (sparse_csr, "layout is torch.sparse_csr"),
        "complex": (torch.randn(8, dtype=torch.complex64), "torch.complex64 is complex"),
        "quantized": (quantized, "quantized"),
        "nested": (nested, "nested tensor"),
        "subclass": (OpaqueTensor((5,)), "OpaqueTensor, a tensor subclass with its own dispatch"),
    }


def exact(x: torch.Tensor) -> dict[str, float]:
    """The six statistics of ``x`` computed with rationals, rounded to float64."""
    q = [Fraction(v) for v in x.double().reshape(-1).tolist()]
    mean = sum(q, Fraction(0)) / len(q)
    m2 = sum(((v - mean) ** 2 for v in q), Fraction(0))
    return {
        "min": float(min(q)),
        "max": float(max(q)),
        "mean": float(mean),
        "std": math.sqrt(m2 / (len(q) - 1)),
        "l1_norm": float(sum(abs(v) for v in q)),
        "l2_norm": math.sqrt(sum(v * v for v in q)),
    }


def base_config() -> dict:
    feature = {"enabled": True, "stats": STATS, "tensors": ["activation"]}
    return {"all": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "LogTensorStats": feature}}


def skip_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "are skipped" in str(w.message)]


def test_unreadable_tensors_are_skipped_with_one_warning_and_every_other_statistic_is_logged(log_dir: Path):
    collect = Collect()
    debug_api.initialize(base_config(), statistics_logger=collect, log_dir=log_dir)
    bad = unreadable()
    g = torch.Generator().manual_seed(0)
    good = {(f"good{i}", step): torch.randn(50, generator=g) * (i + 1) + step for i in range(2) for step in range(STEPS)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            debug_api.log_tensor_stats("good0", tensor=good[("good0", step)], tensor_name="activation")
            for case, (tensor, _) in bad.items():
                debug_api.log_tensor_stats(f"bad_{case}", tensor=tensor, tensor_name="activation")
            debug_api.log_tensor_stats("good1", tensor=good[("good1", step)], tensor_name="activation")
            debug_api.step()
        debug_api.end_debug()
    for (layer, step), tensor in good.items():
        for stat, want in exact(tensor).items():
            assert collect.values[(f"{layer}_activation_{stat}", step)] == pytest.approx(want, rel=1e-6), (layer, step, stat)
    assert len(collect.values) == len(good) * len(STATS)  # nothing of the skipped tensors
    said = skip_warnings(caught)
    logged = [message for level, message in read_messages(log_dir) if level == "WARNING" and "are skipped" in message]
    for case, (_, cause) in bad.items():
        expected = f"statistics of tensor 'activation' of layer 'bad_{case}' are skipped: "
        assert len([m for m in said if m.startswith(expected) and cause in m]) == 1, (case, said)
        assert len([m for m in logged if expected in m and cause in m]) == 1, (case, logged)
    assert len(said) == len(bad)


def test_a_meta_lowprec_layer_does_not_stop_the_training_loop_or_the_statistics_of_the_others(log_dir: Path):
    features = {
        "LogTensorStats": {"enabled": True, "stats": ["mean", "l2_norm"], "tensors": ["activation", "weight", "gradient"]},
        "LogFp8TensorStats": {"enabled": True, "stats": ["underflows%", "mse"], "tensors": ["activation", "weight"]},
    }
    config = {"all": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": features}}
    collect = Collect()
    debug_api.initialize(config, feature_dirs=[lowprec.FEATURE_DIR], statistics_logger=collect, log_dir=log_dir)
    torch.manual_seed(0)
    good = lowprec.Linear(16, 8, name="good")
    bad = lowprec.Linear(16, 8, name="bad", device="meta")
    optimizer = torch.optim.SGD(good.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            with lowprec.fp8_autocast(fp8_recipe=lowprec.Float8CurrentScaling()):
                loss = good(torch.randn(4, 16)).square().mean()
                bad(torch.randn(4, 16, device="meta")).square().mean().backward()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            debug_api.step()
        debug_api.end_debug()
    names = {"activation_mean", "activation_l2_norm", "weight_mean", "weight_l2_norm", "gradient_mean", "gradient_l2_norm"}
    names |= {"activation_underflows%", "activation_mse", "weight_underflows%", "weight_mse"}
    assert set(collect.values) == {(f"good_{name}", step) for name in names for step in range(STEPS)}
    assert all(math.isfinite(value) for value in collect.values.values())
    said = skip_warnings(caught)
    assert said and all("layer 'bad'" in m and "meta device" in m for m in said), said
    assert len(said) == len(set(said))  # each tensor once, not once per step


def test_integer_and_bool_tensors_are_read_converted_to_float64(log_dir: Path):
    collect = Collect()
    debug_api.initialize(base_config(), statistics_logger=collect, log_dir=log_dir)
    g = torch.Generator().manual_seed(1)
    tensors = {
        "int64": torch.randint(-(2**40), 2**41, (3000,), generator=g),  # beyond float32's 24 bits
        "int32": torch.randint(-(2**31), 2**31 - 1, (500,), generator=g, dtype=torch.int32),
        "uint8": torch.randint(0, 256, (100,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(200, generator=g) > 0.3,
    }
    for name, tensor in tensors.items():
        debug_api.log_tensor_stats(name, tensor=tensor, tensor_name="activation")
    debug_api.step()
    for name, tensor in tensors.items():
        for stat, want in exact(tensor).items():
            assert collect.values[(f"{name}_activation_{stat}", 0)] == pytest.approx(want, rel=1e-12), (name, stat)


def test_the_operator_names_why_it_cannot_read_a_tensor():
    for tensor, cause in unreadable().values():
        with pytest.raises(TypeError, match=f"tensor_stats cannot read this tensor: .*{cause}"):
            compute_partials(tensor)
