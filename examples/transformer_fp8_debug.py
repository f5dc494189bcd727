"""Seed 003's example: train a TransformerLayer in FP8 while a config disables FP8 for the MLP's forward
GEMMs and logs statistics of the QKV projection's input.

Run: ``python examples/transformer_fp8_debug.py [--steps N] [--log-dir DIR] [--config FILE] [--device D]``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.optim as optim

import lowprec as te
import nvdlfw_inspect.api as debug_api
from lowprec import TransformerLayer

HERE = Path(__file__).resolve().parent


def train(steps: int, log_dir: Path, config: Path, device: str) -> list[float]:
    debug_api.initialize(
        config_file=str(config), feature_dirs=[te.FEATURE_DIR], log_dir=str(log_dir), default_logging_enabled=True
    )
    try:
        torch.manual_seed(0)
        hidden_size = 512
        num_attention_heads = 8
        transformer_layer = TransformerLayer(
            name="transformer_layer",
            hidden_size=hidden_size,
            ffn_hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
        ).to(device)
        dummy_input = torch.randn(10, 32, hidden_size, device=device)
        criterion = nn.MSELoss()
        optimizer = optim.Adam(transformer_layer.parameters(), lr=1e-4)
        dummy_target = torch.randn(10, 32, hidden_size, device=device)
        losses = []
        for _ in range(steps):
            transformer_layer.train()
            optimizer.zero_grad()
            with te.fp8_autocast(enabled=True):
                output = transformer_layer(dummy_input)
            loss = criterion(output, dummy_target)
            loss.backward()
            optimizer.step()
            debug_api.step()
            losses.append(loss.item())
        return losses
    finally:
        debug_api.end_debug()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "lowprec_seed003")
    parser.add_argument("--config", type=Path, default=HERE / "configs" / "seed003_config.yaml")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    losses = train(args.steps, args.log_dir, args.config, args.device)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"Debug log:      {args.log_dir / 'nvdlfw_inspect_logs'}")
    print(f"Statistics log: {args.log_dir / 'nvdlfw_inspect_statistics_logs'}")


if __name__ == "__main__":
    main()
