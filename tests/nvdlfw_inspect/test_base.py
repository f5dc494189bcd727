"""Routing through a namespace API: features, defaults, the call cache, several features per call, hooks."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.base import FeatureOutputs, outputs_equal
from nvdlfw_inspect.debug_features.generic_feature_api import GenericConfigAPIMapper
from nvdlfw_inspect.errors import ConfigError

PROBE_NAMESPACE = textwrap.dedent(
    """
    import copy

    from nvdlfw_inspect.base import BaseConfigAPIMapper, BaseNamespaceAPI
    from nvdlfw_inspect.registry import Registry, api_method

    EVENTS = {"routing": 0, "step": 0, "end": 0, "multi": []}


    class Defaults:
        def scale(self, config, layer_name, **kwargs):
            return {"tensor": kwargs["tensor"]}

        def enabled(self, config, layer_name, **kwargs):
            return False


    @Registry.register_namespace_api(namespace="probe")
    class ProbeAPI(BaseNamespaceAPI):
        def __init__(self):
            super().__init__()
            self._default_api_impl = Defaults()
            self._cacheable_api_kwargs_map = {"scale": ["tensor_name"], "enabled": ["tensor_name"]}

        def input_assertions_hook(self, api_name, **kwargs):
            if "tensor_name" not in kwargs:
                raise TypeError("probe APIs need tensor_name")

        def routing_condition(self, api_name, config, layer_name, feature_obj, **kwargs):
            EVENTS["routing"] += 1
            return feature_obj.parse_config_and_api(config, **kwargs)

        def output_assertions_hook(self, api_name, ret, **kwargs):
            if api_name == "scale" and "tensor" not in ret:
                raise ValueError("scale must return a dict with 'tensor'")

        def is_multiple_feature_invocation_allowed(self, api_name):
            return api_name in ("enabled", "note")

        def handle_multi_feature_output(self, api_name, multi_feature_outputs, features_to_invoke, **kwargs):
            if api_name == "enabled":
                kind = type(multi_feature_outputs).__name__
                EVENTS["multi"].append((kind, multi_feature_outputs.values(), list(features_to_invoke)))
                return any(multi_feature_outputs)
            return super().handle_multi_feature_output(api_name, multi_feature_outputs, features_to_invoke, **kwargs)

        def step(self):
            EVENTS["step"] += 1

        def end_debug(self):
            EVENTS["end"] += 1


    class TensorMapper(BaseConfigAPIMapper):
        def parse_config_and_api(self, config, **kwargs):
            cfg = self._process_tensor_config(copy.deepcopy(config), kwargs["tensor_name"])
            if cfg is None:
                return False, None
            cfg.pop("enabled")
            return True, cfg


    @Registry.register_feature(namespace="probe")
    class Scale(TensorMapper):
        @api_method
        def scale(self, config, layer_name, **kwargs):
            if config.get("drop"):
                return {}
            return {"tensor": kwargs["tensor"] * config["factor"]}

        @api_method
        def enabled(self, config, layer_name, **kwargs):
            return True

        def validate_config(self, config, location):
            if not isinstance(config.get("factor", 1), (int, float)):
                raise location.child("factor").error("must be a number", config["factor"])


    @Registry.register_feature(namespace="probe")
    class Watch(TensorMapper):
        @api_method
        def enabled(self, config, layer_name, **kwargs):
            return config.get("answer", False)

        @api_method
        def note(self, config, layer_name, **kwargs):
            return config["value"]

        @api_method
        def broken(self, config, layer_name, **kwargs):
            return config.missing_attribute


    @Registry.register_feature(namespace="probe")
    class LoudScale(Scale):
        pass
    """
)


@pytest.fixture
def probe(tmp_path):
    """Writes the probe namespace to a feature dir; returns (feature_dir, events dict after initialize)."""
    feature_dir = tmp_path / "probe_features"
    feature_dir.mkdir()
    (feature_dir / "probe_namespace.py").write_text(PROBE_NAMESPACE)
    return feature_dir


def start(probe, log_dir, sections):
    debug_api.initialize(sections, feature_dirs=[probe], log_dir=log_dir)
    return next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(probe / "probe_namespace.py")).EVENTS


def section(layer, **features):
    return {"enabled": True, "layers": {"exact_layer_names": [layer]}, "probe": features}


def test_routes_to_the_configured_feature_with_resolved_config(probe, log_dir):
    start(
        probe,
        log_dir,
        {
            "s": section(
                "net.fc1",
                Scale={"enabled": True, "factor": 2, "tensors_struct": [{"tensor": "weight", "factor": 10}, {"tensor": "act"}]},
            )
        },
    )
    x = torch.tensor([1.0, -3.0])
    assert torch.equal(debug_api.probe.scale("net.fc1", tensor=x, tensor_name="act")["tensor"], x * 2)
    assert torch.equal(debug_api.probe.scale("net.fc1", tensor=x, tensor_name="weight")["tensor"], x * 10)
    # unconfigured tensor and unconfigured layer fall back to the default implementation
    assert debug_api.probe.scale("net.fc1", tensor=x, tensor_name="gradient")["tensor"] is x
    assert debug_api.probe.scale("net.fc2", tensor=x, tensor_name="act")["tensor"] is x
    # no feature and no default: empty dict
    assert debug_api.probe.note("net.fc2", tensor_name="act") == {}


def test_routing_is_cached_per_call_site_layer_and_cacheable_kwargs(probe, log_dir):
    events = start(probe, log_dir, {"s": section("net.fc1", Scale={"enabled": True, "factor": 3, "tensors": ["act"]})})
    x = torch.ones(2)
    for _ in range(5):
        out = debug_api.probe.scale("net.fc1", tensor=x, tensor_name="act")["tensor"]
    assert torch.equal(out, x * 3)
    assert events["routing"] == 1
    for _ in range(5):
        debug_api.probe.scale("net.fc1", tensor=x, tensor_name="weight")
    assert events["routing"] == 2  # a new cacheable kwarg value routes once more
    debug_api.probe.scale("net.fc1", tensor=x, tensor_name="act")  # another line of code: routed again
    assert events["routing"] == 3


def test_a_bound_call_routes_once_and_then_calls_what_route_api_calls(probe, log_dir):
    events = start(
        probe,
        log_dir,
        {
            "s": section(
                "net.fc1",
                Scale={"enabled": True, "factor": 3, "tensors": ["act"]},
                Watch={"enabled": True, "answer": False, "value": 1, "tensors": ["act"]},
            ),
            "t": section("net.fc2", Scale={"enabled": True, "drop": True, "tensors": ["act"]}),
        },
    )
    namespace = debug_api.DEBUG_MANAGER.get_extension_api("probe")
    x = torch.ones(2)
    scale = namespace.bind("net.fc1", "scale", tensor_name="act")
    unserved = namespace.bind("net.fc1", "scale", tensor_name="weight")  # the namespace's default
    several = namespace.bind("net.fc1", "enabled", tensor_name="act")
    assert events["routing"] == 4  # one feature for scale twice, two for enabled
    for _ in range(3):
        assert torch.equal(scale(tensor=x)["tensor"], x * 3)
        assert unserved(tensor=x)["tensor"] is x
        assert several() is True
    assert events["routing"] == 4
    assert [kind for kind, _, _ in events["multi"]] == ["FeatureOutputs"] * 3  # combined by the hook at every call
    with pytest.raises(ValueError, match="scale must return a dict"):  # the output hook checks every bound call
        namespace.bind("net.fc2", "scale", tensor_name="act")(tensor=x)
    with pytest.raises(ValueError, match=r"probe.note is bound with .*none known \(it is routed per call\)"):
        namespace.bind("net.fc1", "note", tensor_name="act")
    with pytest.raises(ValueError, match=r"probe.scale is bound with .*\['tensor_name'\]; got \['gemm'\]"):
        namespace.bind("net.fc1", "scale", gemm="fprop")


def test_non_cacheable_api_routes_every_call(probe, log_dir):
    events = start(probe, log_dir, {"s": section("net.fc1", Watch={"enabled": True, "value": 4, "tensors": ["act"]})})
    for _ in range(3):
        assert debug_api.probe.note("net.fc1", tensor_name="act") == 4
    assert events["routing"] == 3


def test_several_features_combined_by_the_namespace_hook(probe, log_dir):
    events = start(
        probe,
        log_dir,
        {
            "s": section(
                "net.fc1",
                Scale={"enabled": True, "tensors": ["act"]},
                Watch={"enabled": True, "answer": False, "value": 1, "tensors": ["act"]},
            )
        },
    )
    assert debug_api.probe.enabled("net.fc1", tensor_name="act") is True
    assert events["multi"] == [("FeatureOutputs", [True, False], ["Scale", "Watch"])]
    # results of several features are never cached: the hook runs on every call from one line
    for _ in range(3):
        assert debug_api.probe.enabled("net.fc1", tensor_name="act") is True
    assert len(events["multi"]) == 4


def test_default_multi_feature_handler_requires_equal_outputs(probe, log_dir):
    start(
        probe,
        log_dir,
        {
            "a": section("net.fc1", Watch={"enabled": True, "value": 1, "tensors": ["act"]}),
            "b": {"enabled": True, "layers": {"layer_types": ["fc"]}, "probe": {"Scale": {"enabled": True, "tensors": ["act"]}}},
        },
    )
    # only Watch implements note: one feature, its value comes back
    assert debug_api.probe.note("net.fc1", tensor_name="act") == 1


def test_features_from_two_sections_merge_on_one_layer(probe, log_dir):
    events = start(
        probe,
        log_dir,
        {
            "scale_all": {
                "enabled": True,
                "layers": {"layer_types": ["fc"]},
                "probe": {"Scale": {"enabled": True, "factor": 5, "tensors": ["act"]}},
            },
            "watch_one": section("net.fc1", Watch={"enabled": True, "answer": True, "tensors": ["act"]}),
        },
    )
    assert debug_api.probe.enabled("net.fc1", tensor_name="act") is True
    assert events["multi"][0][2] == ["Scale", "Watch"]
    assert torch.equal(debug_api.probe.scale("net.fc1", tensor=torch.ones(1), tensor_name="act")["tensor"], torch.tensor([5.0]))


def test_two_features_on_a_single_feature_api_is_an_error(probe, log_dir):
    start(
        probe,
        log_dir,
        {"s": section("net.fc1", Scale={"enabled": True, "tensors": ["act"]}, LoudScale={"enabled": True, "tensors": ["act"]})},
    )
    with pytest.raises(ValueError, match=r"Only 1 feature may serve probe\.scale for layer 'net\.fc1'.*'Scale', 'LoudScale'"):
        debug_api.probe.scale("net.fc1", tensor=torch.ones(1), tensor_name="act")


def test_inherited_api_methods_are_routable(probe, log_dir):
    start(probe, log_dir, {"s": section("net.fc1", LoudScale={"enabled": True, "factor": 7, "tensors": ["act"]})})
    assert torch.equal(debug_api.probe.scale("net.fc1", tensor=torch.ones(1), tensor_name="act")["tensor"], torch.tensor([7.0]))


def test_feature_errors_propagate_with_context_not_exit(probe, log_dir):
    start(probe, log_dir, {"s": section("net.fc1", Watch={"enabled": True, "tensors": ["act"]})})
    with pytest.raises(AttributeError, match="missing_attribute") as info:
        debug_api.probe.broken("net.fc1", tensor_name="act")
    assert "raised by feature probe.Watch, API broken, layer 'net.fc1'" in info.value.__notes__


def test_output_and_input_hooks_run(probe, log_dir):
    start(probe, log_dir, {"s": section("net.fc1", Scale={"enabled": True, "drop": True, "tensors": ["act"]})})
    for _ in range(2):  # the second call takes the routing cache: the output is checked there too
        with pytest.raises(ValueError, match="scale must return a dict with 'tensor'"):
            debug_api.probe.scale("net.fc1", tensor=torch.ones(1), tensor_name="act")
    with pytest.raises(TypeError, match="probe APIs need tensor_name"):
        debug_api.probe.scale("net.fc1", tensor=torch.ones(1))


def test_feature_validation_runs_at_initialize(probe, log_dir):
    with pytest.raises(ConfigError, match=r"config dict: key 's\.probe\.Scale\.factor': must be a number; got 'big'"):
        start(probe, log_dir, {"s": section("net.fc1", Scale={"enabled": True, "factor": "big", "tensors": ["act"]})})
    assert debug_api.DEBUG_MANAGER is None


def test_unknown_api_names_on_a_namespace(probe, log_dir):
    start(probe, log_dir, {"s": section("net.fc1", Scale={"enabled": True, "tensors": ["act"]})})
    with pytest.raises(AttributeError, match="namespace 'probe' has no API 'scal'.*did you mean 'scale'"):
        debug_api.probe.scal  # noqa: B018
    assert not hasattr(debug_api.probe, "__wrapped__")


def test_step_and_end_debug_reach_the_namespace(probe, log_dir):
    events = start(probe, log_dir, {"s": section("net.fc1", Scale={"enabled": True, "tensors": ["act"]})})
    debug_api.step()
    debug_api.step()
    assert events["step"] == 2 and events["end"] == 0
    debug_api.end_debug()
    assert events["end"] == 1


def test_process_tensor_config_shapes():
    mapper = GenericConfigAPIMapper()
    both = {"tensors": ["weight"], "tensors_struct": [{"tensor": "act", "stats": ["max"]}], "stats": ["min"]}
    assert mapper._process_tensor_config(dict(both), "act") == {"tensors": ["weight"], "tensor": "act", "stats": ["max"]}
    assert mapper._process_tensor_config(dict(both), "weight") is None  # tensors_struct takes precedence
    assert mapper._process_tensor_config({"tensors": "activation"}, "act") is None  # a string is one name
    assert mapper._process_tensor_config({"tensors": "activation"}, "activation") == {"tensor": "activation"}
    with pytest.raises(ValueError, match="Provide 'tensors_struct"):
        mapper._process_tensor_config({}, "act")


def test_outputs_equal_and_feature_outputs():
    assert outputs_equal({"t": torch.ones(2)}, {"t": torch.ones(2)})
    assert not outputs_equal({"t": torch.ones(2)}, {"t": torch.zeros(2)})
    assert not outputs_equal((True, 1), [True, 1])
    assert outputs_equal((True, None), (True, None))
    outputs = FeatureOutputs([1, 2])
    assert outputs.values() == [1, 2] and outputs == [1, 2]
