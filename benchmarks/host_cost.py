"""Host time of a debug call: what the framework costs the CPU that launches the training step.

On a GPU the debugged step is bound by the host (Python work and kernel launches per call), so this
measures that work alone, on tiny CPU tensors whose arithmetic is negligible, ours next to the
reference ``nvdlfw-inspect`` 0.2.2 (in its own environment, see ``harness.reference_python``):

  log_tensor_stats call   one routed ``debug_api.log_tensor_stats`` call with six statistics, its share of
                          ``step()`` included: (8 layers' calls + one ``step()``) / 8
  empty step()            a ``step()`` with nothing to log (debug initialized, nothing fed)
  lowprec inspected       per inspected tensor of a ``lowprec.Linear`` with ``LogTensorStats`` (8 statistics)
  tensor                  and ``LogFp8TensorStats`` (4 statistics) on activation, gradient and weight, FP8
                          delayed scaling: the training step's (forward, backward, SGD) host time beyond
                          the same step without debugging,
                          divided by the inspected tensors (ours only: the reference has no layers)

Each is the fastest of ``--repeats`` interleaved rounds of ``--steps`` steps, one thread. Targets: at most
15 us per call and per inspected tensor, at most 20 us per empty ``step()``.

Run: ``python benchmarks/host_cost.py [--steps N] [--repeats R] [--tiny] [--json PATH] [--no-reference]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from harness import InProcess, Worker, interleave, reference_python, serve

SIX = ["min", "max", "mean", "std", "l1_norm", "l2_norm"]
LAYERS = 8
TARGETS_US = {"log_tensor_stats call": 15.0, "lowprec inspected tensor": 15.0, "empty step()": 20.0}
JSON_KEYS = {
    "log_tensor_stats call": "log_tensor_stats_call_us",
    "empty step()": "empty_step_us",
    "lowprec inspected tensor": "lowprec_inspected_tensor_us",
}


def base_config() -> dict:
    return {
        "stats": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": r"layer\d+"},
            "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": SIX, "freq": 1},
        }
    }


def lowprec_config() -> dict:
    tensors = ["activation", "gradient", "weight"]
    return {
        "stats": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": r"layer\d+"},
            "transformer_engine": {
                "LogTensorStats": {
                    "enabled": True,
                    "tensors": tensors,
                    "stats": ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"],
                },
                "LogFp8TensorStats": {
                    "enabled": True,
                    "tensors": tensors,
                    "stats": ["underflows%", "scale_inv_min", "scale_inv_max", "mse"],
                },
            },
        }
    }


def seconds_per_round(fn: Callable[[], object], steps: int) -> float:
    """Seconds per call of ``fn`` over ``steps`` calls, after a few warm-up calls (routing, first logs)."""
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def time_calls(steps: int, log_dir: str) -> float:
    """Seconds per routed call, its share of ``step()`` included."""
    import nvdlfw_inspect.api as debug_api

    x = torch.randn(4, 4)
    names = [f"layer{i}" for i in range(LAYERS)]

    def one_step() -> None:
        for name in names:
            debug_api.log_tensor_stats(layer_name=name, tensor=x, tensor_name="activation")
        debug_api.step()

    debug_api.initialize(config_file=base_config(), log_dir=log_dir)
    try:
        return seconds_per_round(one_step, steps) / LAYERS
    finally:
        debug_api.end_debug()


def time_empty_step(steps: int, log_dir: str) -> float:
    import nvdlfw_inspect.api as debug_api

    debug_api.initialize(config_file=base_config(), log_dir=log_dir)
    try:
        return seconds_per_round(debug_api.step, steps * LAYERS)
    finally:
        debug_api.end_debug()


def time_lowprec(steps: int, log_dir: str, debug: bool) -> float:
    """Seconds per training step (forward, backward, SGD) of ``LAYERS`` tiny ``lowprec.Linear`` layers in FP8
    delayed scaling."""
    import lowprec
    import nvdlfw_inspect.api as debug_api

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[lowprec.Linear(16, 16, name=f"layer{i}") for i in range(LAYERS)])
    x = torch.randn(4, 16)
    recipe = lowprec.DelayedScaling()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)  # weights change every step, as in training

    def one_step() -> None:
        with lowprec.fp8_autocast(fp8_recipe=recipe):
            out = model(x)
        out.sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if debug:
            debug_api.step()

    if not debug:
        return seconds_per_round(one_step, steps)
    debug_api.initialize(config_file=lowprec_config(), feature_dirs=[lowprec.FEATURE_DIR], log_dir=log_dir)
    try:
        return seconds_per_round(one_step, steps)
    finally:
        debug_api.end_debug()


def run_variant(variant: str, steps: int, log_dir: str) -> float:
    torch.set_num_threads(1)
    if variant == "call":
        return time_calls(steps, log_dir)
    if variant == "empty step":
        return time_empty_step(steps, log_dir)
    return time_lowprec(steps, log_dir, debug=variant == "lowprec debug")


def measure(args: argparse.Namespace) -> tuple[dict[str, float | None], str | None]:
    """Microseconds per measure for ours and (when it can be set up) the reference; the reason it could not."""
    with tempfile.TemporaryDirectory() as log_dir:
        ours = InProcess(lambda variant: run_variant(variant, args.steps, log_dir))
        plan = [(f"ours {v}", ours, v) for v in ("call", "empty step", "lowprec plain", "lowprec debug")]
        workers: list = []
        reason = "skipped (--no-reference)" if args.no_reference else None
        if not args.no_reference:
            python, reason = reference_python()
            if python is not None:
                reference = Worker(python, Path(__file__), ["--steps", str(args.steps)])
                workers.append(reference)
                plan += [(f"reference {v}", reference, v) for v in ("call", "empty step")]
        try:
            fastest = interleave(plan, args.repeats)
        finally:
            for worker in workers:
                worker.close()
    inspected = LAYERS * 3
    us = {
        "log_tensor_stats call": fastest["ours call"] * 1e6,
        "empty step()": fastest["ours empty step"] * 1e6,
        "lowprec inspected tensor": (fastest["ours lowprec debug"] - fastest["ours lowprec plain"]) * 1e6 / inspected,
        "reference log_tensor_stats call": fastest.get("reference call"),
        "reference empty step()": fastest.get("reference empty step"),
    }
    for key in ("reference log_tensor_stats call", "reference empty step()"):
        if us[key] is not None:
            us[key] *= 1e6
    return us, reason


def print_table(us: dict[str, float | None], reason: str | None) -> None:
    print(f"host time per debug call, tiny CPU tensors, 1 thread ({sys.platform}, torch {torch.__version__})")
    print(f"{'measure':<28} {'ours us':>9} {'reference us':>13} {'target us':>10}")
    for measure, target in TARGETS_US.items():
        reference = us.get(f"reference {measure}")
        shown = f"{reference:>13.1f}" if reference is not None else f"{'-':>13}"
        print(f"{measure:<28} {us[measure]:>9.1f} {shown} {target:>10.1f}")
    if reason:
        print(f"reference: not measured ({reason})")


def write_json(path: str, us: dict[str, float | None], reason: str | None) -> None:
    measures = {JSON_KEYS[measure]: us[measure] for measure in TARGETS_US}
    measures["reference_log_tensor_stats_call_us"] = us["reference log_tensor_stats call"]
    measures["reference_empty_step_us"] = us["reference empty step()"]
    if reason:
        measures["reference_missing_reason"] = reason
    Path(path).write_text(json.dumps({"benchmark": "host_cost", "device": "cpu", "measures": measures}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="steps per timing round")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds (fastest reported: noise only adds time)")
    parser.add_argument("--tiny", action="store_true", help="a quick run (20 steps, 2 rounds): checks the plan, not the numbers")
    parser.add_argument("--json", help="also write the measures to this JSON file")
    parser.add_argument("--no-reference", action="store_true", help="do not time the reference nvdlfw-inspect")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        with tempfile.TemporaryDirectory() as log_dir:
            serve(lambda variant: run_variant(variant, args.steps, log_dir))
        return
    if args.tiny:
        args.steps, args.repeats = 20, 2
    us, reason = measure(args)
    print_table(us, reason)
    if args.json:
        write_json(args.json, us, reason)


if __name__ == "__main__":
    main()
