"""Train the same small MLP with its first layer's forward GEMM in fp32, in bf16-like (7 mantissa bits)
and in a 3-bit-mantissa format, using the user-written ``UserProvidedPrecision`` feature.

Run: ``python examples/user_precision/run_user_precision.py [--steps N] [--log-dir DIR]``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import lowprec
import nvdlfw_inspect.api as debug_api

HERE = Path(__file__).resolve().parent


def config(mantissa_bits: int) -> dict:
    return {
        "narrow_fc1": {
            "enabled": True,
            "layers": {"layer_types": ["fc1"]},
            "transformer_engine": {
                "UserProvidedPrecision": {
                    "enabled": True,
                    "mantissa_bits": mantissa_bits,
                    "gemms": ["fprop"],
                    "tensors": ["activation", "weight"],
                }
            },
        }
    }


def train(mantissa_bits: int, steps: int, log_dir: Path) -> float:
    """Final loss of a 2-layer MLP regression whose ``mlp.fc1`` fprop operands are rounded."""
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(8, 64))
    model.add_module("act", torch.nn.Tanh())
    model.add_module("fc2", torch.nn.Linear(64, 1))
    lowprec.convert(model, prefix="mlp")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(512, 8)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    debug_api.initialize(config_file=config(mantissa_bits), feature_dirs=[HERE], log_dir=str(log_dir))
    try:
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            debug_api.step()
    finally:
        debug_api.end_debug()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "lowprec_user_precision")
    args = parser.parse_args()
    for bits in (23, 7, 3):
        print(f"fc1 fprop with {bits:2d} mantissa bits: final loss {train(bits, args.steps, args.log_dir):.5f}")


if __name__ == "__main__":
    main()
