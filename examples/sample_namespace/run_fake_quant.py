"""Seed 000's custom-namespace example end to end: FakeQuant on the attention output projection's input.

Run: ``python examples/sample_namespace/run_fake_quant.py [--log-dir DIR]``. It builds a two-layer
model whose attention layers call ``debug_api.sample_namespace.process_tensor`` exactly as the seed
shows, runs it with and without the config, and prints how far the fake-quantized output moved.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import yaml

import nvdlfw_inspect.api as debug_api

HERE = Path(__file__).resolve().parent


class AttentionLayer(torch.nn.Module):
    """A stand-in attention block: QKV projection, a mixing step, then the output projection."""

    def __init__(self, name: str, hidden: int = 32):
        super().__init__()
        self.name = name
        self.linear_qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.linear_proj = torch.nn.Linear(hidden, hidden)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        q, k, v = self.linear_qkv(inp).chunk(3, dim=-1)
        hidden = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v
        # Only layers and tensors the config selects are fake-quantized; others come back unchanged.
        hidden = debug_api.sample_namespace.process_tensor(
            layer_name=f"{self.name}.attention", tensor=hidden, tensor_name="linear_proj_in"
        )["tensor"]
        return self.linear_proj(hidden)


def build_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(AttentionLayer("layer1"), AttentionLayer("layer2"))


def run(log_dir: Path, config: Path = HERE / "fake_quant_config.yaml") -> float:
    """Largest change the config causes in the model output, against a run with the config disabled."""
    model = build_model()
    inp = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))
    disabled = yaml.safe_load(config.read_text())
    for section in disabled.values():
        section["enabled"] = False
    debug_api.initialize(config_file=disabled, feature_dirs=[HERE], log_dir=log_dir)
    with torch.no_grad():
        reference = model(inp)
    debug_api.end_debug()

    debug_api.initialize(config_file=config, feature_dirs=[HERE], log_dir=log_dir)
    try:
        with torch.no_grad():
            quantized = model(inp)
        debug_api.step()
    finally:
        debug_api.end_debug()
    return (quantized - reference).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "nvdlfw_inspect_fake_quant")
    args = parser.parse_args()
    change = run(args.log_dir)
    print(f"FakeQuant changed the model output by at most {change:.4g}")
    print(f"Debug log: {args.log_dir / 'nvdlfw_inspect_logs'}")


if __name__ == "__main__":
    main()
