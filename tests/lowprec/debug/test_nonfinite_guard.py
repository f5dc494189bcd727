"""NonfiniteGuard: the first NaN of a step named (layer, GEMM, tensor, micro-batch), the update skipped, the run marked."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from debugrun import section, start
from test_no_host_sync import host_reads_forbidden

import lowprec
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.errors import ConfigError, NonFiniteError

MXFP8 = lowprec.MXFP8BlockScaling()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = lowprec.Linear(32, 64)
        self.fc2 = lowprec.Linear(64, 32)

    def forward(self, x, poison=False):
        y = self.fc1(x)
        if poison:  # the gradient reaching fc1's backward turns NaN
            y.register_hook(lambda grad: grad * float("nan"))
        return self.fc2(torch.relu(y))


def run(log_dir, mode=None, steps=3, poison_at=(1, 1), guard=True, recipe=MXFP8):
    """``steps`` steps of 2 micro-batches, the NaN planted at (step, micro-batch) ``poison_at``; what each step did."""
    options = {} if mode is None else {"on_nonfinite": mode}
    start(section({"NonfiniteGuard": {"enabled": True, **options}}), log_dir)
    model = Net()
    debug_api.infer_and_assign_layer_names(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if guard:
        debug_api.guard_optimizer(optimizer)
    x = torch.randn(16, 32)
    outcomes = []
    for step in range(steps):
        for micro_batch in range(2):
            with lowprec.autocast(recipe=recipe):
                out = model(x, poison=(step, micro_batch) == poison_at)
            out.float().pow(2).mean().backward()
        before = [p.detach().clone() for p in model.parameters()]
        outcome = "stepped"
        try:
            optimizer.step()
        except NonFiniteError as error:
            outcome = error
        unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        optimizer.zero_grad()
        try:
            debug_api.step()
        except NonFiniteError as error:
            outcome = ("step raised", error)
        outcomes.append((outcome, unchanged))
    return outcomes


def test_raise_mode_skips_the_update_and_names_the_first_tensor(log_dir):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcomes = run(log_dir, "raise")
    assert outcomes[0] == ("stepped", False)
    error, unchanged = outcomes[1]
    assert isinstance(error, NonFiniteError) and unchanged  # weights bitwise unchanged
    assert (error.layer, error.gemm, error.tensor, error.micro_batch, error.step) == ("model.fc1", "dgrad", "gradient", 1, 1)
    assert "layer model.fc1, tensor gradient of the dgrad GEMM (and wgrad), micro-batch 1" in str(error)
    # the poisoned gradients were accumulated into .grad and zeroed: the next step is clean again
    assert outcomes[2] == ("stepped", False)
    assert [str(w.message) for w in caught if "NonfiniteGuard" in str(w.message)] == [f"NonfiniteGuard: {error}"]
    assert debug_api.run_poisoned() == str(error)
    log = (log_dir / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    assert f"NonfiniteGuard: {error}" in log


def test_warn_mode_warns_and_skips(log_dir):
    with pytest.warns(RuntimeWarning, match="first in layer model.fc1, tensor gradient"):
        outcomes = run(log_dir)
    assert outcomes == [("stepped", False), ("stepped", True), ("stepped", False)]
    assert "step 1" in debug_api.run_poisoned()


def test_raise_mode_without_the_optimizer_guard_raises_at_step(log_dir):
    with pytest.warns(RuntimeWarning):
        outcomes = run(log_dir, "raise", steps=2, guard=False)
    (what, error), unchanged = outcomes[1]
    assert what == "step raised" and error.step == 1 and not unchanged


def test_clean_tensors_say_nothing(log_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        outcomes = run(log_dir, "raise", poison_at=None)
    assert outcomes == [("stepped", False)] * 3
    assert debug_api.run_poisoned() is None


def test_the_guard_reads_nothing_back_inside_the_step(log_dir, monkeypatch):
    start(section({"NonfiniteGuard": {"enabled": True}}), log_dir)
    model = Net()
    debug_api.infer_and_assign_layer_names(model)
    x = torch.randn(16, 32)
    for micro_batch in range(2):
        with host_reads_forbidden(monkeypatch), lowprec.autocast(recipe=MXFP8):
            model(x, poison=micro_batch == 1).float().sum().backward()
    with pytest.warns(RuntimeWarning, match="micro-batch 1"):
        debug_api.step()


def test_dump_tensors_dump_is_named(log_dir):
    config = section(
        {
            "NonfiniteGuard": {"enabled": True},
            "DumpTensors": {"enabled": True, "tensors": ["gradient"], "high_precision_tensor": True},
        }
    )
    start(config, log_dir)
    model = Net()
    debug_api.infer_and_assign_layer_names(model)
    with lowprec.autocast(recipe=MXFP8):
        model(torch.randn(4, 32), poison=True).float().sum().backward()
    with pytest.warns(RuntimeWarning, match=r"DumpTensors saved it \(its last micro-batch\) to .*model_fc1_gradient.pt"):
        debug_api.step()


@pytest.mark.parametrize("value", ["stop", 1])
def test_a_bad_mode_is_a_config_error(log_dir, value):
    config = section({"NonfiniteGuard": {"enabled": True, "on_nonfinite": value}})
    with pytest.raises(ConfigError, match=r"key 'sec.transformer_engine.NonfiniteGuard.on_nonfinite'.*allowed: 'warn', 'raise'"):
        start(config, log_dir)


def test_the_guard_names_the_expert_whose_gradient_went_nan(log_dir):
    start(section({"NonfiniteGuard": {"enabled": True, "on_nonfinite": "raise"}}), log_dir)
    torch.manual_seed(0)
    experts = lowprec.GroupedLinear(4, 32, 32, name="moe")
    splits = [32, 32, 32, 32]
    poisoned_rows = torch.zeros(128, 1)
    poisoned_rows[64:96] = float("nan")  # the rows routed to expert 2
    optimizer = debug_api.guard_optimizer(torch.optim.SGD(experts.parameters(), lr=0.1))
    with lowprec.autocast(recipe=MXFP8):
        y = experts(torch.randn(128, 32), splits)
    y.register_hook(lambda grad: grad + poisoned_rows)
    y.float().pow(2).mean().backward()
    before = experts.weight.detach().clone()
    with pytest.warns(RuntimeWarning), pytest.raises(NonFiniteError, match="layer moe.gemm_2, tensor gradient") as raised:
        optimizer.step()
    assert torch.equal(before, experts.weight) and (raised.value.layer, raised.value.micro_batch) == ("moe.gemm_2", 0)


def test_the_config_of_the_docs_runs(log_dir):
    docs = (Path(__file__).parents[3] / "docs" / "features.md").read_text()
    example = docs.split("### Stopping a poisoned step")[1].split("```yaml\n")[1].split("```")[0]
    start(yaml.safe_load(example), log_dir)
    model = Net()
    debug_api.infer_and_assign_layer_names(model)
    with lowprec.autocast(recipe=MXFP8):
        model(torch.randn(4, 32), poison=True).float().sum().backward()
    with pytest.warns(RuntimeWarning), pytest.raises(NonFiniteError, match="layer model.fc1"):
        debug_api.step()


def test_a_failure_of_the_guard_itself_does_not_stop_training(log_dir, monkeypatch):
    from lowprec.debug.features.nonfinite_guard import NonfiniteGuard

    def broken(*args, **kwargs):
        raise RuntimeError("bookkeeping broke")

    start(section({"NonfiniteGuard": {"enabled": True, "on_nonfinite": "raise"}}), log_dir)
    model = Net()
    debug_api.infer_and_assign_layer_names(model)
    with lowprec.autocast(recipe=MXFP8):
        model(torch.randn(4, 32)).float().sum().backward()
    monkeypatch.setattr(NonfiniteGuard, "verdict", broken)
    optimizer = debug_api.guard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match="could not read this step's flags: RuntimeError: bookkeeping broke"):
        optimizer.step()  # steps: the failure counts as finite
    debug_api.step()
    monkeypatch.setattr(NonfiniteGuard, "_record", broken)
    with pytest.warns(UserWarning, match="could not check model.fc1"), lowprec.autocast(recipe=MXFP8):
        model(torch.randn(4, 32)).float().sum().backward()


@pytest.fixture(params=["auto", "emulated"])
def kernel_mode(request):
    """Either the C kernels (a CPU tensor's check is their pass) or torch alone (``aminmax``)."""
    previous = lowprec.kernels.set_kernel_mode(request.param)
    yield request.param
    lowprec.kernels.set_kernel_mode(previous)


@pytest.mark.parametrize(
    ("stats", "logged_at"),
    [
        (None, set()),
        ({"freq": 3}, {0, 3}),  # inspected at every iteration for the guard; the statistics feature keeps its schedule
    ],
)
def test_the_guards_plan_stands_across_iterations_and_checks_every_step(log_dir, stats, logged_at, monkeypatch):
    """The guard answers once for every iteration: the layer plans at its first forward only."""
    from debugrun import make_linear, train_step
    from logreader import read_stats

    import lowprec.debug.layer_state as layer_state

    planned = []
    original = layer_state.build_plan
    monkeypatch.setattr(layer_state, "build_plan", lambda name, it, *rest: planned.append(it) or original(name, it, *rest))
    features = {"NonfiniteGuard": {"enabled": True}}
    if stats is not None:
        features["LogTensorStats"] = {"enabled": True, "tensors": ["activation"], "stats": ["max"], **stats}
    start(section(features), log_dir)
    layer = make_linear()
    verdicts = []
    for step in range(6):
        x = torch.randn(2, 32)
        if step == 5:
            x[0, 0] = float("nan")
        train_step(layer, x, torch.randn(2, 24))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            debug_api.step()
        verdicts.append([str(w.message) for w in caught if "non-finite" in str(w.message)])
    debug_api.end_debug()
    assert planned == [0]
    assert {iteration for _, iteration in read_stats(log_dir)} == logged_at
    assert verdicts[:5] == [[]] * 5
    assert len(verdicts[5]) == 1 and "layer lin, tensor activation" in verdicts[5][0], verdicts[5]


def test_a_step_no_tensor_reached_costs_the_guard_nothing_without_a_reduction_group(log_dir):
    """The session finds the guard in its config; a step in which none of its layers ran (its section selects none
    here) makes no op and reads nothing in ``step()``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from debugrun import make_linear, train_step
    from harness import count_ops

    start(section({"NonfiniteGuard": {"enabled": True}}, layers={"layer_name_regex_pattern": "^no such layer$"}), log_dir)
    assert debug_api.DEBUG_MANAGER.guard is not None
    layer = make_linear()
    for _ in range(2):
        train_step(layer, torch.randn(2, 32), torch.randn(2, 24))
        assert sum(count_ops(debug_api.step).values()) == 0


def test_each_tensor_costs_one_op_and_the_first_nan_or_infinity_is_found_across_dtypes(log_dir, kernel_mode):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from harness import count_ops

    from lowprec.debug.features.nonfinite_guard import NonfiniteGuard

    start(section({"NonfiniteGuard": {"enabled": True}}), log_dir)
    guard = NonfiniteGuard()
    finite = torch.full((4, 4), 3e38)  # its sum would overflow: the extrema do not
    tensors = [
        ("a", finite),
        ("b", torch.empty(0)),  # nothing to check
        ("c", torch.tensor([1.0, -float("inf")], dtype=torch.bfloat16)),
        ("d", torch.tensor([float("nan"), 1.0])),
    ]
    for layer, tensor in tensors:
        ops = count_ops(lambda layer=layer, tensor=tensor: guard._record(layer, "activation", tensor, None, "warn"))
        # none for the empty tensor; on a CPU the C kernel's pass (its result scalar allocated), else aminmax
        one_op = {"aten::empty.memory_format": 1} if kernel_mode == "auto" else {"aten::aminmax": 1}
        assert dict(ops) == ({} if tensor.numel() == 0 else one_op), ops
    error, mode = guard.verdict(step=5, group=None)
    assert (error.layer, error.tensor, error.step, mode) == ("c", "activation", 5, "warn")
    guard.reset()
    guard._record("a", "activation", finite, None, "warn")
    assert guard.verdict(step=6, group=None) is None
    # a cast's probe stands for the tensor: no op of the guard's own, and its verdict (not the tensor's) counts
    guard.reset()
    for layer, probe in (("a", torch.tensor(0.0)), ("b", torch.tensor(float("nan")))):
        ops = count_ops(lambda layer=layer, probe=probe: guard._record(layer, "activation", finite, probe, "warn"))
        assert sum(ops.values()) == 0, ops
    error, _ = guard.verdict(step=7, group=None)
    assert (error.layer, error.step) == ("b", 7)


def test_the_reported_micro_batch_follows_the_order_of_calls_empty_tensors_included(log_dir):
    """The micro-batch of the reported call is worked out at the verdict from the step's order of calls: forward calls
    count the model's first tensor's repeats, a backward tensor takes its layer's matching forward; empty tensors (an
    expert no token reached) have no row of extrema but are calls all the same."""
    from lowprec.debug.features.nonfinite_guard import NonfiniteGuard

    start(section({"NonfiniteGuard": {"enabled": True}}), log_dir)
    guard = NonfiniteGuard()
    finite, empty, nan = torch.ones(2), torch.empty(0), torch.tensor([float("nan")])
    step = [("l0", "activation", finite), ("l1", "activation", empty)]  # micro-batch 0: l1 receives no token
    step += [("l1", "gradient", empty), ("l1", "dgrad", empty), ("l0", "gradient", finite)]  # its backward
    step += [("l0", "activation", finite), ("l1", "activation", finite)]  # micro-batch 1
    step += [("l1", "gradient", finite), ("l1", "dgrad", nan)]
    for layer, tensor_name, tensor in step:
        guard._record(layer, tensor_name, tensor, None, "warn")
    error, _ = guard.verdict(step=3, group=None)
    assert (error.layer, error.tensor, error.micro_batch) == ("l1", "dgrad", 1)
    guard.reset()
    for layer, tensor_name, tensor in [*step[:6], ("l1", "activation", nan)]:  # the first non-empty tensor of l1
        guard._record(layer, tensor_name, tensor, None, "warn")
    error, _ = guard.verdict(step=4, group=None)
    assert (error.layer, error.tensor, error.micro_batch) == ("l1", "activation", 1)
    guard.reset()
    for layer, tensor_name, tensor in [("l1", "activation", empty), ("l0", "gradient", nan)]:
        guard._record(layer, tensor_name, tensor, None, "warn")
    error, _ = guard.verdict(step=5, group=None)
    assert (error.layer, error.tensor, error.micro_batch) == ("l0", "gradient", 0)


@pytest.mark.parametrize(
    "recipe",
    [lowprec.DelayedScaling(), lowprec.Float8CurrentScaling(), MXFP8, lowprec.NVFP4BlockScaling()],
    ids=["delayed", "current", "mxfp8", "nvfp4"],
)
def test_operands_a_cast_reads_are_checked_by_the_casts_own_read(tmp_path, recipe, monkeypatch):
    """The C kernels that cast (a per-tensor cast's amax pass, a block cast) also tell whether the tensor held NaN or
    inf: the guard reads only the GEMM outputs itself (with the C kernel's pass, not torch's ``aminmax``), and names
    the same first tensor as when it reads every tensor with ``aminmax`` (torch casts, kernel mode "emulated")."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from harness import count_ops

    from lowprec.kernels import cpu_cast

    own_reads = []  # the tensors the guard's own C pass read
    probe = cpu_cast.nonfinite_probe
    monkeypatch.setattr(cpu_cast, "nonfinite_probe", lambda t: own_reads.append(t) or probe(t))
    verdicts, reads = {}, {}
    for kernels in ("auto", "emulated"):
        previous = lowprec.kernels.set_kernel_mode(kernels)
        try:
            outcomes = run(tmp_path / kernels, "raise", recipe=recipe)
            debug_api.end_debug()
            start(section({"NonfiniteGuard": {"enabled": True}}), tmp_path / f"{kernels}-ops")
            model, x = Net(), torch.randn(16, 32)
            debug_api.infer_and_assign_layer_names(model)

            def micro_batch(model=model, x=x):
                with lowprec.autocast(recipe=recipe):
                    out = model(x)
                out.float().pow(2).mean().backward()  # sum()'s gradient is expanded: not contiguous, read by torch

            micro_batch()  # the first call routes the questions
            own_reads.clear()
            aminmax = count_ops(micro_batch)["aten::aminmax"]
            reads[kernels] = (aminmax, sum(cpu_cast.scans(t) for t in own_reads))
            debug_api.end_debug()
        finally:
            lowprec.kernels.set_kernel_mode(previous)
        error, unchanged = outcomes[1]
        assert isinstance(error, NonFiniteError) and unchanged
        verdicts[kernels] = (error.layer, error.gemm, error.tensor, error.micro_batch, error.step)
    assert verdicts["auto"] == verdicts["emulated"] == ("model.fc1", "dgrad", "gradient", 1, 1)  # a cast operand
    # fc1: activation, weight, gradient, output, wgrad (no dgrad: x needs no gradient); fc2: the six. With the C
    # kernels the guard reads the outputs only (fc1's output, wgrad; fc2's output, dgrad, wgrad), and not even those
    # after a per-tensor FP8 GEMM, whose epilogue (the C kernel's scaling of the product) checked them
    per_tensor = isinstance(recipe, lowprec.DelayedScaling | lowprec.Float8CurrentScaling)
    assert (reads["emulated"], reads["auto"]) == ((11, 0), (0, 0 if per_tensor else 5))


@pytest.mark.parametrize("kernels", ["auto", "emulated"])
@pytest.mark.parametrize(
    ("where", "dtype"), [("bias", torch.float32), ("overflow", torch.float16)], ids=["inf bias", "fp16 overflow"]
)
def test_a_gemm_output_gone_non_finite_from_finite_operands_is_named(log_dir, kernels, where, dtype, monkeypatch):
    """Finite operands, a non-finite result: an infinite bias, or an fp16 output that overflows (finite in fp32). With
    the C kernels the emulated FP8 GEMM's epilogue tells the guard (it reads no output itself); with torch's
    emulation the guard's own read does: both name fc2's output."""
    from lowprec.kernels import cpu_cast

    own_reads = []
    probe = cpu_cast.nonfinite_probe
    monkeypatch.setattr(cpu_cast, "nonfinite_probe", lambda t: own_reads.append(t) or probe(t))
    previous = lowprec.kernels.set_kernel_mode(kernels)
    try:
        start(section({"NonfiniteGuard": {"enabled": True, "on_nonfinite": "raise"}}), log_dir)
        model = Net().to(dtype)
        with torch.no_grad():
            if where == "bias":
                model.fc2.bias[5] = float("inf")
            else:
                model.fc2.weight[5] = 4000.0  # output 5 sums 64 of them times relu(y): ~1e5, finite in fp32 only
                model.fc1.bias = model.fc2.bias = None  # (the epilogue adds fp32 biases only; torch adds the others)
        debug_api.infer_and_assign_layer_names(model)
        with lowprec.autocast(recipe=lowprec.Float8CurrentScaling()):
            out = model(torch.randn(16, 32, dtype=dtype))
        assert not torch.isfinite(out).all() and torch.isfinite(model.fc2.weight).all()
        with pytest.raises(NonFiniteError) as error:
            debug_api.step()
    finally:
        lowprec.kernels.set_kernel_mode(previous)
    assert (error.value.layer, error.value.gemm, error.value.tensor) == ("model.fc2", "fprop", "output")
    if kernels == "auto":
        assert own_reads == []  # operands: their casts' reads; outputs: the GEMMs' epilogues
