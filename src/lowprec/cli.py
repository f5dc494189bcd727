"""The installed ``nvdlfw-inspect`` command: ``nvdlfw_inspect``'s command line with lowprec's features loaded
(``transformer_engine`` configs validate as they are), lowprec's ``demo`` and ``compare``.

It lives here, above both packages, because ``nvdlfw_inspect`` never imports ``lowprec``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import lowprec  # noqa: F401  (importing it makes every initialize load its features)
from lowprec.errors import LowprecValueError
from lowprec.plan import load_plan
from nvdlfw_inspect import cli
from nvdlfw_inspect.errors import ConfigError

PLAN_HELP = (
    "a precision plan: lowprec's format or Megatron-LM's precision file (a debug config holding a precision_plan: key "
    "serves too); the layers its rules select train in the formats it gives them"
)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def demo_arguments(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--steps", type=positive_int, default=300, help="training steps (default 300)")
    sub.add_argument("--size", choices=["tiny", "small", "base"], default="small", help="model size (default small)")
    sub.add_argument("--config", help="a YAML config instead of the demo's")
    sub.add_argument("--plan", help=PLAN_HELP + " (without --config: statistics suited to them)")
    sub.add_argument("--log-dir", default="./demo_logs", help="where logs and the report go (default ./demo_logs)")
    sub.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    sub.add_argument(
        "--threads", type=positive_int, default=None, help="torch's CPU threads (default: OMP_NUM_THREADS, else the free cores)"
    )


def bad_plan(text: str | None) -> bool:
    """Whether ``--plan`` names a plan with mistakes, then printed as ``validate`` prints a config's (``file:line:
    message``), so that the command stops before anything starts. Its warnings are said when the run reads it."""
    if text is None:
        return False
    path = Path(text)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            load_plan(path)
        except ConfigError as error:
            cli.print_config_errors(path, getattr(error, "errors", [error]))
            return True
    return False


def demo(args: argparse.Namespace) -> int:
    """Check the given config and plan first, as ``validate`` does: a bad one is reported once, and no log is
    started. A run that logged nothing says why in one line (exit code 1)."""
    if args.config is not None:
        path = Path(args.config)
        errors = cli.config_errors(path, [])
        if errors:
            cli.print_config_errors(path, errors)
            return 1
    if bad_plan(args.plan):
        return 1
    from lowprec.demo import run_demo

    try:
        run_demo(
            steps=args.steps,
            size=args.size,
            config=args.config,
            log_dir=args.log_dir,
            device=args.device,
            threads=args.threads,
            plan=args.plan,
        )
    except LowprecValueError as error:  # e.g. a config that logged nothing: said in one line, exit code 1
        raise cli.UserError(str(error)) from None
    return 0


DEMO = cli.Command(
    "demo", "Train a small GPT on text shipped with Python in emulated FP8, with statistics and a report.", demo_arguments, demo
)


def recipe_names(text: str) -> list[str]:
    from lowprec.compare import parse_recipes

    try:
        return parse_recipes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


MODEL_HELP = (
    "train your own model instead of the demo GPT: module:function, an importable function (e.g. mypkg.models:make) "
    "called with no argument after torch.manual_seed(seed), returning (model, batch_fn): a torch.nn.Module whose "
    "forward(batch) returns the scalar loss, and batch_fn(step) returning that step's batch (drawn after a "
    "torch.manual_seed the seed fixes, so every recipe reads the same batches). Its linear layers are converted by "
    "lowprec.convert and every layer's statistics logged (.*); --plan is resolved against them; --size does not apply. "
    "Ready-made: lowprec.compare.zoo:llama (a small Llama) and lowprec.compare.zoo:moe (a small Mixtral)"
)
#: the flags that train, with their defaults: given beside run directories they are an error
TRAINING_DEFAULTS = {
    "recipes": None,
    "plan": None,
    "plan_recipe": None,
    "steps": 100,
    "size": "tiny",
    "seed": 0,
    "seeds": 1,
    "device": None,
    "threads": None,
    "model": None,
}


def compare_arguments(sub: argparse.ArgumentParser) -> None:
    from lowprec.compare import DEFAULT_RECIPES, RECIPES
    from lowprec.compare.recipes import autocast_recipes
    from lowprec.demo import SIZES

    known, default = ",".join(RECIPES), ",".join(DEFAULT_RECIPES)
    sub.add_argument(
        "dirs",
        nargs="*",
        metavar="DIR",
        help="run directories that already exist (statistics, optional loss.json): compared without training; the "
        "training flags do not apply",
    )
    sub.add_argument("--recipes", type=recipe_names, default=None, help=f"comma-separated, from {known} (default: {default})")
    sub.add_argument("--plan", default=None, help=PLAN_HELP + "; trained as one more run, 'plan', on the same page")
    sub.add_argument(
        "--plan-recipe",
        choices=autocast_recipes(),
        default=None,
        help="the recipe of the layers the plan leaves to the autocast (default: high precision)",
    )
    sub.add_argument("--model", default=None, help=MODEL_HELP)
    sub.add_argument("--steps", type=positive_int, default=None, help="training steps per recipe (default 100)")
    sub.add_argument("--size", choices=list(SIZES), default=None, help="model size (default tiny)")
    sub.add_argument("--out", default="./compare_logs", help="where the runs and compare.html go (default ./compare_logs)")
    sub.add_argument(
        "--seed", type=non_negative_int, default=None, help="weights and batch order, the same for every recipe (default 0)"
    )
    sub.add_argument(
        "--seeds",
        type=positive_int,
        default=None,
        help="train every recipe with the seeds SEED to SEED+N-1 (in OUT/<recipe>/seed<k> when N > 1), for the "
        "seed-to-seed noise the bottom line compares each gap with (default 1: no noise estimate)",
    )
    sub.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    sub.add_argument(
        "--threads", type=positive_int, default=None, help="torch's CPU threads (default: OMP_NUM_THREADS, else the free cores)"
    )


def compare(args: argparse.Namespace) -> int:
    """A run directory that already holds logs, or a bad plan, is a user error, found before any training. With
    run directories, nothing trains and a training flag is a user error."""
    from lowprec.compare import DEFAULT_RECIPES, compare_dirs, compare_formats

    if args.dirs:
        given = [f"--{name.replace('_', '-')}" for name in TRAINING_DEFAULTS if getattr(args, name) is not None]
        if given:
            raise cli.UserError(
                f"compare DIR ... compares runs that exist, without training: {', '.join(given)} "
                "only apply when compare trains (give no DIR)"
            )
    elif bad_plan(args.plan):
        return 1
    values = {
        name: default if getattr(args, name) is None else getattr(args, name) for name, default in TRAINING_DEFAULTS.items()
    }
    values["recipes"] = values["recipes"] or list(DEFAULT_RECIPES)
    try:
        page = compare_dirs(args.dirs, args.out) if args.dirs else compare_formats(out=args.out, **values)
    except ValueError as error:
        raise cli.UserError(str(error)) from None
    print(f"page: {page}")
    return 0


COMPARE = cli.Command(
    "compare",
    "Train the demo GPT (or your model) once per recipe (high precision, FP8, MXFP8, NVFP4...) and seed, or read runs "
    "that exist; one page compares them, with a bottom line per recipe.",
    compare_arguments,
    compare,
)


def format_names(text: str) -> list[str]:
    from lowprec.plan.cost import formats_on

    names = [name.strip() for name in text.split(",") if name.strip()]
    try:
        return formats_on(None, names)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def plan_arguments(sub: argparse.ArgumentParser) -> None:
    from lowprec.demo import SIZES
    from lowprec.plan.cost import FORMAT_BITS, GPU_SPEEDUP

    sub.add_argument(
        "--formats",
        type=format_names,
        default=["nvfp4", "mxfp8", "bf16"],
        help=f"candidate formats, comma-separated, from {','.join(FORMAT_BITS)} (default nvfp4,mxfp8,bf16; bf16 is "
        "always a candidate)",
    )
    sub.add_argument("--model", default=None, help=MODEL_HELP)
    sub.add_argument("--size", choices=list(SIZES), default="tiny", help="the demo GPT's size (default tiny)")
    sub.add_argument("--steps", type=positive_int, default=60, help="training steps of every run (default 60)")
    sub.add_argument(
        "--seeds",
        type=positive_int,
        default=3,
        help="seeds of every run: the spread of high precision sets the budget (default 3)",
    )
    sub.add_argument(
        "--budget",
        type=float,
        default=1.0,
        help="the loss gap to high precision allowed, in units of its seed-to-seed standard deviation (default 1)",
    )
    sub.add_argument(
        "--gpu",
        choices=list(GPU_SPEEDUP),
        default=None,
        help="cost each GEMM by its time on this GPU instead of the bits it reads: b300 and h200 from Transformer "
        "Engine's measured GEMM times per direction, h100 and b200 from the data sheets' dense throughput; formats "
        "it lacks are dropped, with a warning",
    )
    sub.add_argument("--rounds", type=non_negative_int, default=2, help="re-searches after a plan misses the budget (default 2)")
    sub.add_argument("--out", default="./plan_logs", help="where the runs, plan.yaml and plan.html go (default ./plan_logs)")
    sub.add_argument("--seed", type=non_negative_int, default=0, help="the first seed (default 0)")
    sub.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    sub.add_argument(
        "--threads", type=positive_int, default=None, help="torch's CPU threads (default: OMP_NUM_THREADS, else the free cores)"
    )


def plan(args: argparse.Namespace) -> int:
    from lowprec.planner.find import find_plan

    try:
        found = find_plan(
            model=args.model,
            size=args.size,
            candidates=args.formats,
            steps=args.steps,
            seeds=args.seeds,
            budget=args.budget,
            gpu=args.gpu,
            out=args.out,
            rounds=args.rounds,
            seed=args.seed,
            device=args.device,
            threads=args.threads,
        )
    except ValueError as error:
        raise cli.UserError(str(error)) from None
    final = found.final
    verdict = "within" if final.within_budget else "NOT within"
    print(
        f"plan: {found.plan_file}: measured gap {final.measured_gap:+.4g} (predicted {final.predicted_gap:+.4g}), {verdict} "
        f"the budget {found.budget:.4g} ({found.budget_units:g} x the seed-to-seed spread {found.noise:.4g}); "
        f"the whole model in {found.cheapest}: {found.cheapest_gap:+.4g}"
    )
    print(f"page: {Path(args.out) / 'plan.html'}")
    return 0


PLAN = cli.Command(
    "plan",
    "Find the cheapest per-layer precision plan that trains like high precision: calibrate, search, prove with compare.",
    plan_arguments,
    plan,
)


def main(argv: Sequence[str] | None = None) -> int:
    description = (
        "Validate configs, list and explain features, write reports, diagnose runs, run the demo, compare formats, "
        "find a precision plan."
    )
    return cli.main(argv, extra=[DEMO, COMPARE, PLAN], description=description)


if __name__ == "__main__":
    sys.exit(main())
