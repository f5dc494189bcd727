"""Every python snippet of the README and of the pages in docs/ runs as written, each in a fresh directory
holding the YAML files the pages name for it and, for snippets that read ``demo_logs``, a short demo run; some
are checked for what the pages say they print or log. Every shell command is one the scripts install, and every
``transformer_engine`` config initializes."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from logreader import read_stats

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: the pages whose code blocks are kept running: the README, then docs/ in name order
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
OPTIONAL = ("wandb", "tensorboard", "pandas", "transformers", "lightning", "accelerate")


def fenced_blocks(page: Path) -> list[tuple[str, str, str | None, str]]:
    """(language, section heading, file named on the line before the block as "`name.yaml`:", text) of one page."""
    blocks, heading, previous, lines = [], "", "", iter(page.read_text().splitlines())
    for line in lines:
        if line.startswith("```"):
            body = []
            for inner in lines:
                if inner.startswith("```"):
                    break
                body.append(inner)
            named = re.fullmatch(r"`([\w.-]+\.ya?ml)`:", previous)
            blocks.append((line[3:].strip(), heading, named and named.group(1), "\n".join(body) + "\n"))
        elif line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.strip():
            previous = line.strip()
    return blocks


BLOCKS = [block for page in PAGES for block in fenced_blocks(page)]
#: python snippets by the heading of their section, which is unique across the pages (CHECKS is keyed by it)
SNIPPETS = {heading: code for language, heading, _, code in BLOCKS if language == "python"}
YAML_FILES = {name: text for language, _, name, text in BLOCKS if language == "yaml" and name}


def needs(code: str) -> list[str]:
    """The optional packages a snippet imports, or uses through ``read_stats`` (pandas)."""
    modules = {m for m in OPTIONAL if re.search(rf"^(import|from) {m}\b", code, re.M)}
    return sorted(modules | ({"pandas"} if "read_stats(" in code else set()))


@pytest.fixture(scope="module")
def demo_logs(tmp_path_factory):
    """A short run of the demo, as `bash scripts/demo.sh` leaves in ./demo_logs."""
    from lowprec.demo import run_demo

    log_dir = tmp_path_factory.mktemp("demo") / "demo_logs"
    run_demo(steps=6, size="tiny", log_dir=log_dir)
    return log_dir


def check_quick_start(directory: Path, stdout: str) -> None:
    assert [line.split(" ", 1)[0] for line in stdout.strip().splitlines()] == ["0", "1", "2"]
    stats = read_stats(directory / "quickstart_logs")
    assert {iteration for _, iteration in stats} == {0, 1, 2} and len(stats) == 18
    assert all(name.startswith("model.fc1_activation_") for name, _ in stats)
    assert 0.9 < stats[("model.fc1_activation_std", 0)] < 1.1  # torch.randn


def check_wandb(directory: Path, stdout: str) -> None:
    assert len(list((directory / "wandb").glob("offline-run-*"))) == 1


def check_read_stats(directory: Path, stdout: str) -> None:
    assert stdout.startswith("layer") and len(stdout.strip().splitlines()) >= 3  # a Series: header, rows, dtype
    values = [float(line.split()[-1]) for line in stdout.strip().splitlines()[1:-1]]
    assert values and max(values) < 90  # warm-up set aside: iteration 0's gradients lose over 90%


def check_diagnose(directory: Path, stdout: str) -> None:
    assert stdout.strip().endswith("findings")


C_ATTN_STATS = {f"model.transformer.h.{i}.attn.c_attn_activation_{stat}" for i in (0, 1) for stat in ("max", "l2_norm")}


def check_convert(directory: Path, stdout: str) -> None:
    assert "8 layers converted" in stdout and "skipped model.lm_head (Linear): filtered out" in stdout
    assert set(read_stats(directory / "convert_logs")) == {(name, iteration) for name in C_ATTN_STATS for iteration in range(3)}


def check_training_loop(log_dir: str):
    """The integration snippets: three optimizer steps of c_attn statistics, none from evaluation."""

    def check(directory: Path, stdout: str) -> None:
        assert set(read_stats(directory / log_dir)) == {(name, iteration) for name in C_ATTN_STATS for iteration in range(3)}

    return check


def check_fp8_debugging(directory: Path, stdout: str) -> None:
    stats = read_stats(directory / "log")
    layer = "transformer_layer.self_attention.layernorm_qkv_activation_"
    assert set(stats) == {(layer + stat, i) for stat in ("max", "min", "mean", "std", "l1_norm") for i in range(2, 6)}
    plan = (directory / "log" / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    assert "transformer_layer.layernorm_mlp.fc1: Tensor: activation, gemm fprop - High precision" in plan


def check_quantize(directory: Path, stdout: str) -> None:
    lines = stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["NVFP4BlockScaling", "MXFP8BlockScaling", "Float8CurrentScaling"]
    errors = [float(line.split("relative error ")[1].split("%")[0]) for line in lines]
    assert errors[0] > 3 * errors[1] and 1 < errors[1] < 5  # 4 bits lose far more than 8
    assert "scales (16, 64) torch.uint8" in lines[0] and "scales (256, 32) torch.uint8" in lines[1]


def check_quantize_details(directory: Path, stdout: str) -> None:
    lines = stdout.strip().splitlines()
    assert lines[0].startswith("signs transformer_engine: global amax ") and "first block scales [" in lines[0]
    errors = [float(line.split("relative error ")[1].rstrip("%")) for line in lines[1:4]]
    assert all(5 < error < 25 for error in errors) and errors[1] == errors[2]  # the Hadamard transform is orthogonal
    assert lines[4] == "MXFP4 scales [nan, 0.25] codes [6, 6, 6, 0, 6] dequantized [nan, nan, 1.0]"  # OCP: 1 = 4 * 2**-2


def check_mx_family(directory: Path, stdout: str) -> None:
    errors = {line.split(":")[0]: float(line.split("relative error ")[1].rstrip("%")) for line in stdout.strip().splitlines()}
    assert len(errors) == 5 and all(0 < error < 30 for error in errors.values())
    assert errors["MXFP4 (OCP scales)"] > errors["MXFP6 E3M2"] > errors["MXFP8"]  # fewer bits, larger errors
    # the snippet is seeded, so the figures the page quotes are what it prints (give or take a last-digit rounding
    # where another BLAS sums in another order)
    quoted = re.search(r"It prints relative output errors of ([^:]+):", (ROOT / "docs" / "formats.md").read_text())
    assert quoted, "docs/formats.md no longer quotes what the MX snippet prints"
    figures = [float(figure) for figure in re.findall(r"([\d.]+)%", quoted.group(1))]
    assert figures == pytest.approx(list(errors.values()), abs=0.15)


def check_compare(directory: Path, stdout: str) -> None:
    assert stdout.strip().endswith("compare.html") and (directory / "compare_logs" / "compare.html").exists()
    assert {run.name for run in (directory / "compare_logs").iterdir() if run.is_dir()} == {"bf16", "delayed", "mxfp8"}


def check_precision_plan(directory: Path, stdout: str) -> None:
    lines = stdout.strip().splitlines()
    assert lines[0] == "precision plan dict (lowprec format), first matching rule wins:"
    assert lines[1].startswith("  #0 fc2 in NVFP4: fprop: NVFP4BlockScaling(), dgrad: NVFP4BlockScaling(),")
    assert lines[2].startswith("  #1 fc1's wgrad in BF16: fprop: the recipe of the lowprec.autocast in force,")
    assert "wgrad: high_precision;" in lines[2]


def check_guard(tmp_path: Path, stdout: str) -> None:
    assert "skipped: model.0 activation, micro-batch 1, step 2" in stdout
    assert stdout.rstrip().splitlines()[-1].startswith("non-finite values (NaN or inf) at step 2: first in layer model.0")


CHECKS = {
    "Quick start": check_quick_start,
    "Weights & Biases": check_wandb,
    "Reading a run: report, DataFrame, command line": check_read_stats,
    "Diagnose a run: what is wrong, and a config that fixes it": check_diagnose,
    "FP8 layers: `lowprec`": None,  # its assertion is appended to the snippet
    "Converting an existing model: `lowprec.convert`": check_convert,
    "Comparing formats: `nvdlfw-inspect compare`": check_compare,
    "Training under a plan": check_precision_plan,
    "Hugging Face `Trainer`": check_training_loop("hf_logs"),
    "Lightning": check_training_loop("pl_logs"),
    "accelerate": check_training_loop("acc_logs"),
    "Studying a format on your own tensors: `lowprec.quantize`": check_quantize,
    "Scales as numbers, each orientation's values, the Hadamard domain, reproducible noise": check_quantize_details,
    "Block-scaled recipes: MXFP8, FP8 block scaling, NVFP4, the OCP MX family (MXFP6, MXFP4)": check_mx_family,
    "Debugging FP8 training (config namespace `transformer_engine`)": check_fp8_debugging,
    "Stopping a poisoned step: NonfiniteGuard": check_guard,
}
APPENDED = {
    "FP8 layers: `lowprec`": "assert y.shape == (16, 32) and x.grad.shape == (16, 64) and layer.weight.grad is not None\n"
}


def test_every_snippet_is_known():
    headings = [heading for language, heading, _, _ in BLOCKS if language == "python"]
    assert len(headings) == len(set(headings)), "two python snippets under one heading: give each its own section"
    assert set(SNIPPETS) == set(CHECKS), "a python snippet was added or its section renamed: list it in CHECKS"
    assert set(YAML_FILES) == {"convert_config.yaml", "config.yaml"}


@pytest.mark.parametrize("heading", list(SNIPPETS))
def test_snippet_runs_as_written(heading, tmp_path, request):
    code = SNIPPETS[heading]
    for module in needs(code):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (pip install -e .[dev])")
    for name, text in YAML_FILES.items():
        (tmp_path / name).write_text(text)
    if "demo_logs" in code:
        shutil.copytree(request.getfixturevalue("demo_logs"), tmp_path / "demo_logs")
    code += APPENDED.get(heading, "")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    if CHECKS.get(heading):
        CHECKS[heading](tmp_path, result.stdout)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_every_shell_command_runs_as_written_after_the_two_scripts():
    """The scripts leave the user's shell alone: a documented command is a script or one the scripts install
    into .venv/bin, never a bare `nvdlfw-inspect`, which no PATH finds after them (issue 26)."""
    import tomllib

    root = ROOT
    assert 'VENV="$ROOT/.venv"' in (root / "scripts" / "env.sh").read_text()
    installed = {"python", *tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]}
    lines = [line.split("#")[0].split() for language, _, _, text in BLOCKS if language == "bash" for line in text.splitlines()]
    commands = [[word for word in words if "=" not in word] for words in lines if words]
    assert len(commands) >= 6
    for words in commands:
        if words[0] == "bash":
            assert (root / words[1]).is_file(), words
        else:
            assert words[0].startswith(".venv/bin/") and words[0].removeprefix(".venv/bin/") in installed, words


def test_every_transformer_engine_config_in_the_pages_initializes(tmp_path):
    """The feature examples are configs users copy: each must pass validation as written."""
    import lowprec
    import nvdlfw_inspect.api as debug_api

    configs = [text for language, _, _, text in BLOCKS if language == "yaml" and "transformer_engine:" in text]
    assert len(configs) >= 3
    for i, text in enumerate(configs):
        path = tmp_path / f"config{i}.yaml"
        path.write_text(text)
        debug_api.initialize(config_file=str(path), feature_dirs=[lowprec.FEATURE_DIR], log_dir=str(tmp_path / f"log{i}"))
        debug_api.end_debug()
