"""The partials layout is defined once, in ``stats.fields``, and the C kernel, the Triton kernel and the torch
merge agree with it: the C source names fields through the layout generated from fields.py and defines none
of its own, the Triton kernel's offsets and rules are constexprs built from it, each kernel fills every field
the layout says the operator fills, and the compiled C kernel merges every field by its rule. (The Triton
kernel's merge is checked the same way in its interpreter: ``kernels/triton_checks.py``.)"""

from __future__ import annotations

import importlib.util
import math
import re
from importlib import resources
from pathlib import Path

import pytest
import torch

from nvdlfw_inspect.stats import fields
from nvdlfw_inspect.stats.fields import FIELDS, INDEX, LAYOUT, MERGE_RULES, empty_partials, filled_by, merge_partials
from nvdlfw_inspect.stats.kernels import cpu
from nvdlfw_inspect.stats.kernels.fallback import torch_tensor_stats

C_SOURCE = resources.files("nvdlfw_inspect.stats.kernels").joinpath("cpu_partials.c").read_text(encoding="utf-8")
OPERATOR_FIELDS = {*filled_by("tensor"), *filled_by("grid"), *filled_by("scale"), *filled_by("moments")}
IDENTITY = {"sum": 0.0, "chan": 0.0, "min": math.inf, "max": -math.inf}
E4M3 = (448.0, -6, 3)


def test_the_layout_is_consistent():
    assert len(set(FIELDS)) == len(FIELDS) and INDEX == {name: i for i, name in enumerate(FIELDS)}
    for field in LAYOUT:
        assert field.merge in MERGE_RULES and field.filled_by in fields.FILLERS, field
        assert field.identity == IDENTITY[field.merge], field  # the identity of its merge rule
    assert {field.name for field in LAYOUT if field.merge == "chan"} == {"mean", "m2", "m3", "m4"}  # merge_partials' formulas
    assert fields.OPTIONAL_FIELDS <= set(filled_by("tensor"))
    assert empty_partials().tolist() == [field.identity for field in LAYOUT]


# --- the C kernel --------------------------------------------------------------------------------------


def generated_layout() -> tuple[dict[str, int], list[str], list[float]]:
    """The field indices, rules and identities as the generated C header states them."""
    header = cpu.layout_header()
    enums = re.findall(r"enum \{([^}]*)\}", header)
    indices = dict(re.findall(r"(F_\w+) = (\d+)", enums[1]))
    rules = re.search(r"FIELD_RULE\[N_FIELDS\] = \{([^}]*)\}", header).group(1).split(", ")
    identities = re.search(r"FIELD_IDENTITY\[N_FIELDS\] = \{([^}]*)\}", header).group(1).split(", ")
    constants = {"INFINITY": math.inf, "-INFINITY": -math.inf}
    assert f"N_FIELDS = {len(FIELDS)}" in header
    return {k: int(v) for k, v in indices.items()}, rules, [constants[x] if x in constants else float(x) for x in identities]


def test_the_generated_c_layout_is_the_layout():
    indices, rules, identities = generated_layout()
    assert indices == {cpu.c_name(name): i for i, name in enumerate(FIELDS)}
    assert rules == [f"RULE_{field.merge.upper()}" for field in LAYOUT]
    assert identities == [field.identity for field in LAYOUT]


def test_the_c_source_defines_no_layout_of_its_own():
    code = re.sub(r"/\*.*?\*/", "", C_SOURCE, flags=re.DOTALL)
    assert not re.search(r"\b(F_\w+|N_FIELDS|FIELD_RULE|FIELD_IDENTITY|RULE_\w+)\s*=[^=]", code), "a layout name is defined"
    assert not re.search(r"\b(row|own|into|add|call_out|FIELD_IDENTITY)\s*\[\s*\d+\s*\]", code), "a field indexed by number"
    used = set(re.findall(r"\bF_\w+\b", code))
    assert used <= {cpu.c_name(name) for name in FIELDS}, used
    written = {name for name in FIELDS if re.search(rf"(row|own)\[{cpu.c_name(name)}\] =", code)}
    assert written == OPERATOR_FIELDS  # every field the operator fills, and no other


@pytest.fixture
def c_kernel():
    kernel = cpu.native_kernel()
    if kernel is None:
        pytest.skip("no C compiler: the kernel cannot be built")
    return kernel


def prefilled(own: torch.Tensor) -> torch.Tensor:
    """A row holding values that every merge rule combines differently with ``own`` (sum, min and max
    of two distinct positive, or mixed, values all differ), the fields the operator leaves alone included."""
    row = own * 1.5 + 0.25
    row[INDEX["count"]] = 100.0
    row[INDEX["blockwise_dr"]] = 3.0
    return row


def test_the_c_kernel_merges_every_field_by_its_rule(c_kernel):
    # magnitudes from 1e-6 to 1e2: some values overflow E4M3 at this scale, some underflow
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 2, 5000)
    scale = torch.tensor(10.0)
    args = ([0], [0], [scale], [E4M3[0]], [E4M3[1]], [E4M3[2]], True, None, None, True)  # M3 and M4 too
    fresh = empty_partials().view(1, -1)
    c_kernel(x, fresh, *args)
    before = prefilled(fresh[0])
    merged = before.clone().view(1, -1)
    c_kernel(x, merged, *args)
    want = merge_partials(torch.stack([before, fresh[0]]))
    for name in FIELDS:
        got, expected = merged[0, INDEX[name]].item(), want[INDEX[name]].item()
        assert got == pytest.approx(expected, rel=1e-12) if fields.BY_NAME[name].merge == "chan" else got == expected, name
    assert all(fresh[0, INDEX[name]] != fields.BY_NAME[name].identity for name in OPERATOR_FIELDS)  # each one filled
    reference = empty_partials().view(1, -1)
    torch_tensor_stats(x, reference, *args)  # the torch reductions leave the same fields alone
    for name in set(FIELDS) - OPERATOR_FIELDS:
        assert fresh[0, INDEX[name]] == reference[0, INDEX[name]] == fields.BY_NAME[name].identity, name
    for name in OPERATOR_FIELDS:
        assert fresh[0, INDEX[name]].item() == pytest.approx(reference[0, INDEX[name]].item(), rel=1e-9), name


# --- the Triton kernel ---------------------------------------------------------------------------------

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


@needs_triton
def test_the_triton_offsets_and_rules_are_the_layout():
    from nvdlfw_inspect.stats.kernels import triton

    constants = {name: value.value for name, value in vars(triton).items() if re.fullmatch(r"[FRS]_[A-Z0-9_]+", name)}
    offsets = {name[2:].lower(): value for name, value in constants.items() if name.startswith("F_")}
    assert offsets == {name: INDEX[name] for name in OPERATOR_FIELDS}
    rules = {name[2:].lower(): value for name, value in constants.items() if name.startswith("R_")}
    chan = {name for name in OPERATOR_FIELDS if fields.BY_NAME[name].merge == "chan"}  # merged with the count
    assert rules == {name: MERGE_RULES.index(fields.BY_NAME[name].merge) for name in OPERATOR_FIELDS - chan - {"count"}}
    assert triton.N_FIELDS.value == len(FIELDS)
    # a program's scratch row: its tensor fields, then MAX_VARIANTS values of each grid field
    tensor, grid = filled_by("tensor") + filled_by("moments"), filled_by("grid")
    assert triton.SCRATCH_FIELDS == triton.SCRATCH_ROW.value == len(tensor) + len(grid) * triton.MAX_VARIANTS
    scratch = {name[2:].lower(): value for name, value in constants.items() if name.startswith("S_")}
    per_grid = triton.MAX_VARIANTS
    want = {name: tensor.index(name) for name in tensor}
    want |= {name: len(tensor) + grid.index(name) * per_grid for name in grid}
    assert scratch == want


@needs_triton
def test_the_triton_source_numbers_no_field():
    source = Path(importlib.util.find_spec("nvdlfw_inspect.stats.kernels.triton").origin).read_text(encoding="utf-8")
    assert not re.search(r"\b(base|own|rows|call_out_ptr)\s*\+\s*\d", source), "a field offset written as a number"
    assert not re.search(r"\b(SCRATCH_FIELDS|N_FIELDS|[FRS]_[A-Z0-9_]+)\s*=\s*(tl\.constexpr\()?\d", source)
    written = set(re.findall(r"(?:base|call_out_ptr) \+ F_([A-Z0-9_]+)", source))
    assert {name.lower() for name in written} == OPERATOR_FIELDS
