"""The demo: a small GPT of ``lowprec.TransformerLayer``s learns Python's own documentation in FP8.

The text is ``pydoc_data.topics`` (the help texts that ship with CPython), read as bytes. The config
(``demo_config.yaml`` unless another is given) logs tensor and FP8 statistics and runs one GEMM in
high precision. At the end the demo writes the HTML report and the loss of every step (``loss.json``, which
``nvdlfw-inspect compare`` reads back) and prints where everything is.

With a precision plan (``lowprec.plan``) the layers its rules select train in the formats it gives them; without a
config of its own the run then logs ``plan_statistics_config``'s statistics, which suit a model of several formats.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

import lowprec
import nvdlfw_inspect.api as debug_api
from lowprec.debug.names import INPUT_TENSORS, TENSOR_GEMMS
from lowprec.errors import LowprecValueError
from lowprec.modules.base import gemm_leaves
from lowprec.plan import GEMMS, GemmRecipes, PrecisionPlan, load_plan
from lowprec.plan.recipes import describe
from lowprec.recipe import Recipe
from nvdlfw_inspect import invocation
from nvdlfw_inspect.errors import is_int
from nvdlfw_inspect.files import WriteError, file_system, write_text_atomic
from nvdlfw_inspect.logging import MAIN_LOG_DIR, STATISTICS_LOG_DIR, STATISTICS_RECORDS_DIR, get_logger

DEMO_CONFIG = Path(__file__).resolve().parent / "demo_config.yaml"
LOSS_FILE = "loss.json"
PLAN_CONFIG = "plan_config.yaml"
#: the quantization statistics of a run under a precision plan: each defined in every layer's own format
PLAN_STATS = ("underflows%", "mse")
DEMO_RECIPE = lowprec.DelayedScaling()
#: high enough that attention logits grow (Wortsman et al., 2023, "Small-scale proxies for large-scale Transformer
#: training instabilities"): the attention saturates and the gradient into its QKV projection spans more binades
#: than E5M2 holds, the precision problem the demo exhibits (2e-3 trains as well here and exhibits none)
DEMO_LEARNING_RATE = 1e-2
#: the layers a run's statistics select: the demo GPT's, or every layer of a model of the user's own
GPT_LAYERS, EVERY_LAYER = r"gpt\..*", ".*"
DEBUG_LAYER_NAMES = (
    "gpt.layers.<i>.self_attention.layernorm_qkv, gpt.layers.<i>.self_attention.proj, gpt.layers.<i>.layernorm_mlp.fc1, "
    "gpt.layers.<i>.layernorm_mlp.fc2, gpt.head"
)


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    seq: int
    batch: int


SIZES = {
    "tiny": Size(hidden=64, layers=2, heads=4, seq=64, batch=16),
    "small": Size(hidden=128, layers=4, heads=4, seq=64, batch=16),
    "base": Size(hidden=256, layers=6, heads=8, seq=128, batch=32),
}


def corpus() -> torch.Tensor:
    """Python's help topics as a byte tensor."""
    from pydoc_data.topics import topics

    return torch.tensor(list("\n\n".join(topics.values()).encode()), dtype=torch.long)


class GPT(torch.nn.Module):
    """Byte-level causal language model: embeddings, ``layers`` TransformerLayers, a final LayerNorm and
    an FP8 ``Linear`` head. Layers are named ``gpt.layers.{i}`` and ``gpt.head``; those calling the debug API are
    ``DEBUG_LAYER_NAMES``."""

    def __init__(self, size: Size):
        super().__init__()
        self.token = torch.nn.Embedding(256, size.hidden)
        self.position = torch.nn.Embedding(size.seq, size.hidden)
        self.layers = torch.nn.ModuleList(
            lowprec.TransformerLayer(
                size.hidden,
                4 * size.hidden,
                size.heads,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                attn_input_format="bshd",
                name=f"gpt.layers.{i}",
            )
            for i in range(size.layers)
        )
        self.norm = torch.nn.LayerNorm(size.hidden)
        self.head = lowprec.Linear(size.hidden, 256, name="gpt.head")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.token(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def model_gemm_layers(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """The GEMM layers of a model of lowprec layers (the GPT, or a model ``lowprec.convert`` converted): each debug
    name and its layer types, as config selectors and plan rules see them. Composite layers count through their
    innermost lowprec layers, whose ``debug_layers`` name each GEMM (an expert's ``{name}.gemm_{i}``)."""
    return {name: types for leaf in gemm_leaves(model) for name, types in leaf.debug_layers()}


def gemm_layers(size: Size) -> dict[str, tuple[str, ...]]:
    """The GPT's GEMM layers (``model_gemm_layers``), read from a model built on the meta device (no memory, no random
    numbers drawn)."""
    with torch.device("meta"):
        return model_gemm_layers(GPT(size))


def planned_recipes(plan: PrecisionPlan, layers: Mapping[str, tuple[str, ...]], recipe: Recipe | None) -> dict[str, GemmRecipes]:
    """Each GEMM layer's training recipes (None: high precision) under ``plan`` in an autocast of ``recipe`` (None: no
    autocast), as the run resolves them; ``layers``: the model's GEMM layers and their types (``gemm_layers``,
    ``model_gemm_layers``)."""
    return {name: plan.resolve(name, types).gemm_recipes(True, recipe) for name, types in layers.items()}


def cast_tensors(recipes: GemmRecipes) -> tuple[str, ...]:
    """The input tensors of a layer that one of its GEMMs casts (the others it reads in high precision only)."""
    return tuple(tensor for tensor in INPUT_TENSORS if any(recipes.of(gemm) is not None for gemm in TENSOR_GEMMS[tensor]))


def plan_statistics_config(planned: Mapping[str, GemmRecipes], freq: int, layers: str = GPT_LAYERS) -> dict:
    """Statistics for a model of several formats: ``LogTensorStats`` of every GEMM input of the ``layers`` (a regex:
    the GPT's, or ``EVERY_LAYER`` for a model of the user's own), and ``LogFp8TensorStats``' ``underflows%`` and
    ``mse`` of each cast tensor in its layer's own format (FP8, MX, block or NVFP4). A tensor no GEMM of its layer
    casts has no own format, so no quantization statistics (a section would refuse it)."""
    config: dict = {
        "plan_tensor_statistics": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": layers},
            "transformer_engine": {
                "LogTensorStats": {
                    "enabled": True,
                    "tensors": list(INPUT_TENSORS),
                    "stats": ["max", "std", "dynamic_range"],
                    "freq": freq,
                }
            },
        }
    }
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, recipes in planned.items():
        tensors = cast_tensors(recipes)
        if tensors:
            groups.setdefault(tensors, []).append(name)
    for tensors, names in groups.items():
        stats = {"enabled": True, "tensors": list(tensors), "stats": list(PLAN_STATS), "freq": freq}
        config[f"plan_quantization_{'_'.join(tensors)}"] = {
            "enabled": True,
            "layers": {"exact_layer_names": names},
            "transformer_engine": {"LogFp8TensorStats": stats},
        }
    return config


def plan_lines(plan: PrecisionPlan, planned: Mapping[str, GemmRecipes], recipe: Recipe | None) -> list[str]:
    """What a run under ``plan`` prints first: the plan, the autocast's recipe, and the layers it leaves in high
    precision."""
    lines = [f"plan:       {plan.describe()}", f"autocast:   {describe(recipe)} (the layers the plan leaves to the autocast)"]
    high = [name for name, recipes in planned.items() if all(recipes.of(gemm) is None for gemm in GEMMS)]
    if high:
        lines.append(f"in high precision: {', '.join(high)}")
    return lines


class RunNotSaved(WriteError):
    """The run trained, but write errors (a full disk) cost part of what it writes: the message names the log
    directory, its file system and each loss; ``result`` holds what ``run_demo`` returns, its ``report`` None
    when none was written."""

    def __init__(self, message: str, result: dict) -> None:
        super().__init__(message)
        self.result = result


def not_saved(log_dir: Path, result: dict, unwritten: list[str]) -> str:
    """Why a run that trained lacks some of its files: the write errors, then the disk to clear."""
    return (
        f"the run trained (loss {result['first_loss']:.3f} -> {result['last_loss']:.3f}), but write errors cost part of "
        f"its files in {str(log_dir)!r}: {'; '.join(unwritten)}. Free space on {file_system(log_dir)}, or give another log dir."
    )


def nothing_logged(config: str | Path, log_dir: Path, steps: int) -> str:
    """Why a demo run logged no statistics, and the fix: the config's features reached none of the GPT's layers."""
    return (
        f"no statistics were logged in {steps} step{'s' if steps > 1 else ''}: no feature of the config {str(config)!r} "
        f"logged a tensor of the demo's layers ({DEBUG_LAYER_NAMES}); lowprec layers call the debug API of namespace "
        "'transformer_engine', so statistics features go under 'transformer_engine:' in a section selecting these names (as in "
        f"{str(DEMO_CONFIG)!r}). The warnings above, also in the debug log {str(log_dir / MAIN_LOG_DIR)!r}, name each "
        f"section that did nothing. No report was written; the losses are in {str(log_dir / LOSS_FILE)!r}."
    )


def check_device(device: str | None) -> str:
    """The device to train on: ``device``, or CUDA when torch sees a GPU. Checked before anything starts: a CUDA
    device without one is otherwise torch's bare ``AssertionError`` from deep inside the model's ``.to``."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    allowed = "'cpu', 'cuda' or 'cuda:N'"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise LowprecValueError(f"device must be {allowed}, got {device!r}") from None
    if parsed.type not in ("cpu", "cuda"):
        raise LowprecValueError(f"device must be {allowed}, got {device!r}")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            built = "built with CUDA" if torch.backends.cuda.is_built() else "a CPU-only build"
            raise LowprecValueError(f"device {device!r}: torch sees no CUDA GPU (torch {torch.__version__}, {built}); use 'cpu'")
        if parsed.index is not None and parsed.index >= count:
            raise LowprecValueError(f"device {device!r}: torch sees {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    return device


def choose_threads(threads: int | None = None) -> tuple[int, str]:
    """How many CPU threads torch should train with, and why. torch's default, one per core, oversubscribes a
    busy machine: 30 demo steps on 2 cores at a load of 8 took 306 s with 2 threads, 30 s with 1. So:
    ``threads`` when given, else ``OMP_NUM_THREADS`` when set, else the cores this process may run on less those
    already busy (the 1-minute load average, rounded), at least 1."""
    if threads is not None:
        if not is_int(threads) or threads < 1:
            raise LowprecValueError(f"threads must be a positive integer, got {threads!r}")
        return threads, "as given"
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads(), f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this system (Windows): count every core free
        return cores, f"{cores} cores, load unknown"
    return max(1, min(cores, cores - round(load))), f"{cores} cores, load {load:.1f}"


def threads_line(threads: int, why: str) -> str:
    """The line the demo and compare print about their threads, with how to choose another count."""
    return f"threads: {threads} ({why}; --threads N or OMP_NUM_THREADS=N to choose)"


def command() -> str:
    """How to run ``nvdlfw-inspect`` from this shell (``invocation.command``), through lowprec's command line
    when no script is installed: it has ``demo`` as well."""
    return invocation.command("lowprec.cli")


class TimeLeft:
    """The time left: steps left times the mean of the last ``window`` step times, each capped at three
    times their median. Steps that log statistics (slower, every few steps) count in full; one very slow
    step (another process taking the CPU) moves the estimate by a few percent, a lasting slowdown within
    half a window."""

    def __init__(self, window: int = 30):
        self.recent: deque[float] = deque(maxlen=window)

    def add(self, seconds: float) -> None:
        self.recent.append(seconds)

    def seconds(self, steps_left: int) -> float:
        if not self.recent:
            return 0.0
        cap = 3 * statistics.median(self.recent)
        return steps_left * sum(min(t, cap) for t in self.recent) / len(self.recent)


def progress(step: int, steps: int, loss: float, left: float) -> None:
    """One line, redrawn in place: a bar, the step, the loss and the time left."""
    filled = int(30 * step / steps)
    bar = "#" * filled + "-" * (30 - filled)
    sys.stderr.write(f"\r[{bar}] step {step}/{steps}  loss {loss:.3f}  {left:4.0f}s left ")
    sys.stderr.flush()


def read_losses(log_dir: str | Path) -> list[float]:
    """The loss of every step of the demo run in ``log_dir``, as the run wrote it."""
    path = Path(log_dir) / LOSS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no demo losses in {str(log_dir)!r} (expected {LOSS_FILE})")
    return json.loads(path.read_text())["loss"]


ModelFactory = Callable[[], tuple[torch.nn.Module, Callable[[int], Any]]]
"""A model of the user's own: called with no argument, it returns ``(model, batch_fn)``, a ``torch.nn.Module`` whose
``forward(batch)`` returns the scalar loss and ``batch_fn(step)`` the batch of that step."""


def _gpt_training(shape: Size, device: str, seed: int) -> tuple[torch.nn.Module, Callable, Callable]:
    """The demo GPT (weights from the seed already set), its batches (windows of the corpus, in an order from
    ``seed + 1``) and its loss (next-byte cross entropy)."""
    text = corpus().to(device)
    model = GPT(shape).to(device)
    generator = torch.Generator().manual_seed(seed + 1)

    def batch(step: int) -> torch.Tensor:
        starts = torch.randint(0, len(text) - shape.seq - 1, (shape.batch,), generator=generator).tolist()
        return torch.stack([text[s : s + shape.seq + 1] for s in starts])

    def loss_of(window: torch.Tensor) -> torch.Tensor:
        logits = model(window[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, 256), window[:, 1:].reshape(-1))

    return model, batch, loss_of


def _to_device(batch: Any, device: str) -> Any:
    """The batch's tensors (alone, or in a tuple, list or dict) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: _to_device(item, device) for key, item in batch.items()}
    return batch


def user_model(factory: ModelFactory, name: str = "model_factory") -> tuple[torch.nn.Module, Callable[[int], Any]]:
    """``factory()`` checked against the contract of ``ModelFactory``; a ``LowprecValueError`` naming ``name``
    (the argument or flag that gave it) and what it returned otherwise."""
    made = factory()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module) and callable(made[1])):
        got = f"a tuple of {', '.join(type(item).__name__ for item in made)}" if isinstance(made, tuple) else type(made).__name__
        raise LowprecValueError(
            f"{name}: {getattr(factory, '__qualname__', factory)!r} must return (model, batch_fn), a torch.nn.Module whose "
            f"forward(batch) returns the loss and a function of the step returning its batch; it returned {got}"
        )
    return made


def _factory_training(factory: ModelFactory, device: str, seed: int) -> tuple[torch.nn.Module, Callable, Callable]:
    """The user's model (made after ``torch.manual_seed(seed)``, its linear layers converted by ``lowprec.convert``
    and named ``model.<path>``), its batches (``torch.manual_seed`` set before each from a sequence that ``seed + 1``
    fixes, so every recipe reads the same ones) and its forward as the loss."""
    model, batch_fn = user_model(factory)
    model = lowprec.convert(model).to(device)
    generator = torch.Generator().manual_seed(seed + 1)

    def batch(step: int) -> Any:
        torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
        return _to_device(batch_fn(step), device)

    def loss_of(inputs: Any) -> torch.Tensor:
        loss = model(inputs)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise LowprecValueError(f"model_factory: the model's forward(batch) must return the scalar loss, got {got}")
        return loss.reshape(())

    return model, batch, loss_of


def optimizer_for(
    model: torch.nn.Module, steps: int, learning_rate: float = DEMO_LEARNING_RATE
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The demo's optimizer (AdamW, weight decay 0.01) and schedule (20 steps of warm-up, then a cosine to 0 at
    ``steps``), which every run of ``run_demo`` and the plan search's calibration train with."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    return optimizer, schedule


def run_demo(
    steps: int = 300,
    size: str = "small",
    config: str | Path | None = None,
    log_dir: str | Path = "./demo_logs",
    device: str | None = None,
    recipe: Recipe | None = DEMO_RECIPE,
    seed: int = 0,
    autocast: torch.dtype | None = None,
    threads: int | None = None,
    learning_rate: float = DEMO_LEARNING_RATE,
    plan: str | os.PathLike | Mapping | PrecisionPlan | None = None,
    factory: ModelFactory | None = None,
) -> dict:
    """Train, log, write the report; returns the first and last losses, every step's loss and the paths written.

    ``recipe`` None trains in high precision (no FP8 autocast). ``seed`` fixes the initial weights (``seed``)
    and the order of the batches (``seed + 1``), so runs with different recipes see the same data.
    ``autocast``: run the forward under ``torch.autocast`` to this dtype (``torch.bfloat16``: mixed precision).
    ``threads``: torch's CPU threads while training (``choose_threads``: by default from the free cores, so that a
    busy machine is not oversubscribed); the caller's setting is restored afterwards. ``learning_rate``: AdamW's
    peak rate (``DEMO_LEARNING_RATE``: high enough for the precision problem the demo exhibits).
    ``plan``: a precision plan (a YAML path, which may be the debug config itself when it holds a ``precision_plan:``
    key; a mapping; a ``lowprec.plan.PrecisionPlan``): the layers its rules select train in its formats, the others
    under ``recipe``. It is printed first and returned (``result["plan"]``); without a ``config`` the run logs
    ``plan_statistics_config``'s statistics (written to ``plan_config.yaml`` in ``log_dir``).
    A run that trained but could not write all its files (a full disk) raises ``RunNotSaved``, which names the
    disk and holds the result; the training is never stopped by it.
    ``factory``: train the user's model instead of the GPT (``ModelFactory``; ``size`` is then unused): it is made
    after ``torch.manual_seed(seed)``, converted by ``lowprec.convert`` (layers ``model.<path>``), and each batch
    drawn after a ``torch.manual_seed`` that ``seed`` fixes. A precision plan is resolved against the converted model's
    layers (``model_gemm_layers``), and its statistics config then selects every layer (``.*``).
    """
    if not is_int(seed) or seed < 0:
        raise LowprecValueError(f"seed must be a non-negative integer, got {seed!r}")
    if size not in SIZES:
        raise LowprecValueError(f"size must be one of {list(SIZES)}, got {size!r}")
    if autocast is not None and autocast not in (torch.bfloat16, torch.float16):
        raise LowprecValueError(f"autocast must be None, torch.bfloat16 or torch.float16, got {autocast!r}")
    if not is_int(steps) or steps < 1:
        raise LowprecValueError(f"steps must be a positive integer, got {steps!r}")
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or not 0 < learning_rate < math.inf:
        raise LowprecValueError(f"learning_rate must be a positive number, got {learning_rate!r}")
    precision_plan = None if plan is None else load_plan(plan)
    device = check_device(device)
    threads, why = choose_threads(threads)
    print(threads_line(threads, why), flush=True)
    shape = SIZES[size]
    log_dir = Path(log_dir)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        built = None
        if precision_plan is not None:
            if factory is not None:  # built before the session opens, to give its statistics config the user's layers
                torch.manual_seed(seed)
                built = _factory_training(factory, device, seed)
            layers = gemm_layers(shape) if built is None else model_gemm_layers(built[0])
            planned = planned_recipes(precision_plan, layers, recipe)
            print("\n".join(plan_lines(precision_plan, planned, recipe)), flush=True)
            if config is None:
                log_dir.mkdir(parents=True, exist_ok=True)
                selected = GPT_LAYERS if factory is None else EVERY_LAYER
                text = yaml.safe_dump(plan_statistics_config(planned, freq=5, layers=selected), sort_keys=False)
                config = write_text_atomic(log_dir / PLAN_CONFIG, text, "the plan's statistics config")
                print(f"config:     {config}  (statistics suited to the plan's formats)", flush=True)
        debug_api.initialize(config_file=str(config or DEMO_CONFIG), feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(log_dir))
        write_faults = get_logger().faults  # still readable after end_debug: which log lines a full disk cost
        if built is None:
            torch.manual_seed(seed)
            built = _gpt_training(shape, device, seed) if factory is None else _factory_training(factory, device, seed)
        model, batch, loss_of = built
        optimizer, schedule = optimizer_for(model, steps, learning_rate)
        losses, started, time_left = [], time.perf_counter(), TimeLeft()
        # a step's cost: this process's CPU time on the CPU, which other processes do not inflate as they do wall
        # time (on a busy machine NVFP4 looked the fastest recipe and is the slowest); on a GPU, wall time
        on_cpu = torch.device(device).type == "cpu"
        clock = time.process_time if on_cpu else time.perf_counter
        training_started = clock()
        for step in range(steps):
            step_started = time.perf_counter()
            inputs = batch(step)
            with (
                torch.autocast(torch.device(device).type, dtype=autocast, enabled=autocast is not None),
                lowprec.autocast(enabled=recipe is not None, recipe=recipe, plan=precision_plan),
            ):
                loss = loss_of(inputs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            debug_api.step()
            losses.append(loss.item())
            time_left.add(time.perf_counter() - step_started)
            if step % 5 == 0 or step == steps - 1:
                progress(step + 1, steps, losses[-1], time_left.seconds(steps - step - 1))
        sys.stderr.write("\n")
        step_ms = (clock() - training_started) / steps * 1e3
    finally:
        debug_api.end_debug()
        torch.set_num_threads(previous_threads)
    from nvdlfw_inspect.report import write_report

    result = {"first_loss": losses[0], "last_loss": sum(losses[-10:]) / min(10, len(losses)), "report": None}
    result["losses"] = losses
    result["plan"] = None if precision_plan is None else precision_plan.describe()
    result["step_ms"], result["step_clock"] = step_ms, "process CPU time" if on_cpu else "wall time"
    result["statistics"] = log_dir / STATISTICS_LOG_DIR
    result["records"] = log_dir / STATISTICS_RECORDS_DIR
    result["debug_log"] = log_dir / MAIN_LOG_DIR
    unwritten = [] if write_faults.first is None else [write_faults.summary() or f"a log write failed: {write_faults.first}"]
    try:
        write_text_atomic(log_dir / LOSS_FILE, json.dumps({"loss": losses}), "the losses")
    except WriteError as error:
        unwritten.append(str(error))
    try:
        result["report"] = report = write_report(log_dir)
    except WriteError as error:
        unwritten.append(str(error))
    except ValueError as error:  # no statistics: the disk's doing when it lost lines, else the config's, said so
        if not unwritten:
            raise LowprecValueError(nothing_logged(config or DEMO_CONFIG, log_dir, steps)) from error
        unwritten.append("no statistics could be read back, so no report was written")
    if unwritten:
        raise RunNotSaved(not_saved(log_dir, result, unwritten), result)
    print(f"loss {result['first_loss']:.3f} -> {result['last_loss']:.3f} in {time.perf_counter() - started:.0f}s on {device}")
    print(f"statistics: {result['statistics']}  (text .log per rank)")
    print(f"records:    {result['records']}  (structured .jsonl per rank)")
    print(f"debug log:  {result['debug_log']}")
    print(f"report:     {report}  (open it in a browser)")
    plan_file = plan if isinstance(plan, (str, os.PathLike)) else None
    for line in next_steps(log_dir, Path(config or DEMO_CONFIG), steps, size, plan_file):
        print(line)
    if precision_plan is not None and plan_file is None:
        print("note:       these commands run without the plan, given as no file: write it to a YAML file for --plan")
    return result


def next_steps(log_dir: Path, config: Path, steps: int, size: str, plan: str | os.PathLike | None = None) -> list[str]:
    """The loop that follows a demo run, as commands this shell can run: diagnose it against its own config (one
    merged config comes out), then train again with that config, same data, size and plan file, into a directory
    beside it."""
    quote, run = lambda path: shlex.quote(str(path)), command()
    fixed = log_dir.with_name(log_dir.name + "_fixed")
    same = "".join(
        f" {flag} {value}" for flag, value, default in (("--steps", steps, 300), ("--size", size, "small")) if value != default
    )
    if plan is not None:
        same += f" --plan {quote(plan)}"
    return [
        f"next:       {run} diagnose {quote(log_dir)} --config {quote(config)}  (findings, and your config with their fixes)",
        f"then:       {run} demo --config {quote(log_dir / 'diagnose_config.yaml')} --log-dir {quote(fixed)}{same}"
        "  (the same run with the fixes, when diagnose wrote them; diagnose it to see them work)",
    ]
