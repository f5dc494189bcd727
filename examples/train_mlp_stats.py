"""Train a plain PyTorch MLP and log tensor statistics of its layers with ``LogTensorStats``.

Run: ``python examples/train_mlp_stats.py [--steps N] [--log-dir DIR] [--config FILE]``. Forward
pre-hooks pass each Linear layer's input to ``debug_api.log_tensor_stats`` as ``activation`` and
backward hooks pass the gradient of its output as ``gradient``; the config decides which layers,
tensors, statistics and steps are logged. At the end it prints where the logs are and a few lines.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import nvdlfw_inspect.api as debug_api

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "configs" / "mlp_stats.yaml"


def build_mlp(width: int = 64, depth: int = 3) -> torch.nn.Module:
    """``depth`` hidden layers ``mlp.fc1`` .. ``mlp.fc{depth}`` with GELU, then ``mlp.out`` (one logit)."""
    layers: dict[str, torch.nn.Module] = {}
    for i in range(1, depth + 1):
        layers[f"fc{i}"] = torch.nn.Linear(16 if i == 1 else width, width)
        layers[f"act{i}"] = torch.nn.GELU()
    layers["out"] = torch.nn.Linear(width, 1)
    return _Named(layers)


class _Named(torch.nn.Sequential):
    """A Sequential whose children keep readable names (``fc1``, ``act1``, ..., ``out``)."""

    def __init__(self, layers: dict[str, torch.nn.Module]):
        super().__init__()
        for name, module in layers.items():
            self.add_module(name, module)


def attach_stat_hooks(model: torch.nn.Module, prefix: str = "mlp") -> None:
    """Send every Linear's input and output gradient to ``debug_api.log_tensor_stats``."""
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        layer_name = f"{prefix}.{name}"

        def log_input(_module, args, layer_name=layer_name):
            debug_api.log_tensor_stats(layer_name=layer_name, tensor=args[0], tensor_name="activation")

        def log_gradient(grad, layer_name=layer_name):
            debug_api.log_tensor_stats(layer_name=layer_name, tensor=grad, tensor_name="gradient")

        def watch_output_gradient(_module, _args, output, log_gradient=log_gradient):
            output.register_hook(log_gradient)

        module.register_forward_pre_hook(log_input)
        module.register_forward_hook(watch_output_gradient)


def train(steps: int, log_dir: Path, config: Path = DEFAULT_CONFIG) -> list[float]:
    """Fit a smooth function of 16 inputs for ``steps`` steps; returns the losses."""
    torch.manual_seed(0)
    model = build_mlp()
    attach_stat_hooks(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    target = 0.25 * torch.randn(16, 1)
    debug_api.initialize(config_file=config, log_dir=log_dir)
    losses = []
    try:
        for _ in range(steps):
            x = torch.randn(256, 16)
            y = torch.sin(x @ target)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            debug_api.step()
            losses.append(loss.item())
    finally:
        debug_api.end_debug()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="training steps (default 50)")
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "nvdlfw_inspect_demo")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="debug config (YAML)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")

    losses = train(args.steps, args.log_dir, args.config)
    stats_dir = args.log_dir / "nvdlfw_inspect_statistics_logs"
    print(f"Trained {args.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"Debug log:      {args.log_dir / 'nvdlfw_inspect_logs'}")
    print(f"Statistics log: {stats_dir}")
    stats_file = next(iter(sorted(stats_dir.glob("*.log"))), None)
    if stats_file is not None:
        lines = stats_file.read_text().splitlines()
        print(f"Last statistics lines of {stats_file.name} ({len(lines)} lines in all):")
        for line in lines[-6:]:
            print("  " + " ".join(line.split()))


if __name__ == "__main__":
    main()
