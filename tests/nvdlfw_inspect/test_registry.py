"""Registry, the registration decorators and api_method discovery."""

from __future__ import annotations

import pytest
from inspect_ns_factory import unique, write_namespace

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.base import BaseConfigAPIMapper, BaseNamespaceAPI
from nvdlfw_inspect.errors import ConfigError, RegistryError
from nvdlfw_inspect.registry import (
    LoadedClasses,
    RegistrationWarning,
    Registry,
    api_method,
    api_names_of,
    registrations_of,
)


@pytest.fixture(autouse=True)
def _empty_registry():
    """Tests here register classes directly; never leak them into another test's initialize."""
    Registry.reset()
    yield
    Registry.reset()


class Api(BaseNamespaceAPI):
    def input_assertions_hook(self, api_name, **kwargs):
        pass

    def routing_condition(self, api_name, config, layer_name, feature_obj, **kwargs):
        return feature_obj.parse_config_and_api(config, **kwargs)

    def output_assertions_hook(self, api_name, ret, **kwargs):
        pass

    def is_multiple_feature_invocation_allowed(self, api_name):
        return False


class Mapper(BaseConfigAPIMapper):
    def parse_config_and_api(self, config, **kwargs):
        return True, config


def make_feature(name: str, *apis: str, base: type = Mapper) -> type:
    """A new feature class called ``name`` whose methods ``apis`` are marked with api_method."""

    class Feature(base):
        pass

    Feature.__name__ = Feature.__qualname__ = name
    for api in apis:
        setattr(Feature, api, api_method(lambda self, config, layer_name, _api=api, **kw: (_api, layer_name)))
    return Feature


def make_api() -> type:
    """A new namespace API class (decorating one class for many namespaces would pile up its tags)."""

    class FreshApi(Api):
        pass

    return FreshApi


# --------------------------------------------------------------------------------------------
# api_method and discovery
# --------------------------------------------------------------------------------------------


def test_api_method_marks_and_returns_the_function():
    def fn(self, config, layer_name):
        return 1

    assert api_method(fn) is fn
    assert fn.is_api is True


def test_api_names_include_inherited_and_skip_private_and_unmarked():
    class Parent(Mapper):
        @api_method
        def parent_api(self, config, layer_name):
            pass

        @api_method
        def _private_api(self, config, layer_name):
            pass

        def helper(self):
            pass

    class Child(Parent):
        @api_method
        def child_api(self, config, layer_name):
            pass

    assert api_names_of(Parent()) == ["parent_api"]
    assert sorted(api_names_of(Child())) == ["child_api", "parent_api"]


def test_api_names_ignore_non_callables_and_failing_properties():
    class Marked:
        is_api = True

    class Feature(Mapper):
        not_callable = Marked()

        @property
        def broken(self):
            raise RuntimeError("property evaluated during discovery")

        @api_method
        def real(self, config, layer_name):
            pass

    assert api_names_of(Feature()) == ["real"]


def test_overriding_without_api_method_drops_the_api():
    class Parent(Mapper):
        @api_method
        def probe(self, config, layer_name):
            pass

    class Child(Parent):
        def probe(self, config, layer_name):  # not marked: no longer an API
            pass

    assert api_names_of(Child()) == []


# --------------------------------------------------------------------------------------------
# registration order, deferral, dedupe
# --------------------------------------------------------------------------------------------


def test_features_before_their_namespace_api_are_deferred_then_registered():
    ns = unique("ns")
    first = Registry.register_feature(namespace=ns)(make_feature("First", "probe"))
    second = Registry.register_feature(namespace=ns)(make_feature("Second", "probe", "other"))
    data = Registry.data[ns]
    assert data.api is None
    assert data.deferred_features == [first, second]
    assert data.features == {}

    fresh = make_api()
    assert Registry.register_namespace_api(namespace=ns)(fresh) is fresh
    assert type(data.api) is fresh
    assert data.deferred_features == []
    assert {name: type(obj) for name, obj in data.features.items()} == {"First": first, "Second": second}
    assert dict(data.feat_api_to_features) == {"probe": ["First", "Second"], "other": ["Second"]}


def test_feature_after_its_namespace_api_is_registered_at_once():
    ns = unique("ns")
    Registry.register_namespace_api(namespace=ns)(make_api())
    feature = make_feature("Feat", "probe")
    assert Registry.register_feature(namespace=ns)(feature) is feature
    assert type(Registry.data[ns].features["Feat"]) is feature
    assert Registry.data[ns].deferred_features == []


def test_registering_the_same_class_twice_keeps_one_instance():
    ns = unique("ns")
    Registry.register_namespace_api(namespace=ns)(make_api())
    feature = make_feature("Feat", "probe")
    Registry.register_feature(namespace=ns)(feature)
    instance = Registry.data[ns].features["Feat"]
    Registry.register_feature(namespace=ns)(feature)
    assert Registry.data[ns].features["Feat"] is instance
    assert Registry.data[ns].feat_api_to_features["probe"] == ["Feat"]


def test_deferred_feature_with_a_reused_name_keeps_the_latest_class():
    ns = unique("ns")
    old = Registry.register_feature(namespace=ns)(make_feature("Feat", "probe"))
    new = Registry.register_feature(namespace=ns)(make_feature("Feat", "probe"))
    assert Registry.data[ns].deferred_features == [new]
    Registry.register_namespace_api(namespace=ns)(make_api())
    assert type(Registry.data[ns].features["Feat"]) is new is not old


def test_same_name_different_class_first_wins_unless_replaced():
    ns = unique("ns")
    Registry.register_namespace_api(namespace=ns)(make_api())
    old = make_feature("Feat", "probe")
    new = make_feature("Feat", "probe", "extra")
    Registry.add_feature(ns, old)
    Registry.add_feature(ns, new)
    assert type(Registry.data[ns].features["Feat"]) is old
    Registry.add_feature(ns, new, replace=True)
    assert type(Registry.data[ns].features["Feat"]) is new
    assert dict(Registry.data[ns].feat_api_to_features) == {"probe": ["Feat"], "extra": ["Feat"]}


def test_reregistering_the_api_class_keeps_its_instance():
    ns = unique("ns")
    api_cls = Registry.register_namespace_api(namespace=ns)(make_api())
    instance = Registry.data[ns].api
    Registry.add_namespace_api(ns, api_cls)
    assert Registry.data[ns].api is instance
    other = make_api()
    Registry.add_namespace_api(ns, other)  # another class replaces it
    assert type(Registry.data[ns].api) is other


def test_subclass_feature_exposes_parent_apis_in_its_namespace():
    ns = unique("ns")
    Registry.register_namespace_api(namespace=ns)(make_api())
    parent = Registry.register_feature(namespace=ns)(make_feature("ParentFeat", "parent_api"))
    Registry.register_feature(namespace=ns)(make_feature("ChildFeat", "child_api", base=parent))
    Registry.validate_and_init()
    api = Registry.data[ns].api
    assert api.api_to_features_map == {"parent_api": ["ParentFeat", "ChildFeat"], "child_api": ["ChildFeat"]}
    assert api.api_names() == {"parent_api", "child_api"}


# --------------------------------------------------------------------------------------------
# validate_and_init
# --------------------------------------------------------------------------------------------


def test_validate_and_init_hands_the_api_its_features():
    ns = unique("ns")
    Registry.register_namespace_api(namespace=ns)(make_api())
    Registry.register_feature(namespace=ns)(make_feature("Feat", "probe"))
    Registry.validate_and_init()
    api = Registry.data[ns].api
    assert api.name == ns
    assert api.namespace_features is Registry.data[ns].features
    assert api.api_to_features_map == {"probe": ["Feat"]}


def test_a_namespace_registered_on_import_without_a_usable_api_is_set_aside_with_a_warning():
    """A module imported for another purpose (the reference's tests import one while collecting) must not
    make every initialize fail: its namespace is set aside, and only a config using it is an error."""
    ns, lonely = unique("ns"), unique("ns")

    class NotAnApi:
        pass

    Registry.register_namespace_api(namespace=ns)(NotAnApi)  # accepted at decoration time
    Registry.register_feature(namespace=lonely)(make_feature("Lonely", "probe"))
    Registry.register_feature(namespace=lonely)(make_feature("Alone", "probe"))
    with pytest.warns(RegistrationWarning) as warned:
        Registry.validate_and_init()
    messages = " ".join(str(w.message) for w in warned)
    assert f"namespace '{ns}'" in messages and "NotAnApi" in messages and "BaseNamespaceAPI" in messages
    assert "['Lonely', 'Alone']" in messages and f"@Registry.register_namespace_api(namespace='{lonely}')" in messages
    assert ns not in Registry.data and lonely not in Registry.data
    assert "BaseNamespaceAPI" in Registry.unusable[ns]


def test_a_config_using_a_namespace_set_aside_names_why(log_dir):
    ns = unique("ns")

    class NotAnApi:
        pass

    Registry.register_namespace_api(namespace=ns)(NotAnApi)
    config = {"sec": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, ns: {"Feat": {"enabled": True}}}}
    with pytest.warns(RegistrationWarning), pytest.raises(ConfigError, match=f"key 'sec.{ns}'.*set aside.*BaseNamespaceAPI"):
        debug_api.initialize(config_file=config, log_dir=log_dir)
    assert debug_api.DEBUG_MANAGER is None


def test_feature_that_cannot_be_built_without_arguments():
    ns = unique("ns")
    Registry.register_namespace_api(namespace=ns)(make_api())

    class NeedsArgs(Mapper):
        def __init__(self, size):
            self.size = size

    with pytest.raises(RegistryError) as info:
        Registry.register_feature(namespace=ns)(NeedsArgs)
    message = str(info.value)
    assert f"feature 'NeedsArgs' of namespace '{ns}'" in message and "no arguments" in message and __file__ in message
    assert isinstance(info.value.__cause__, TypeError)
    assert "NeedsArgs" not in Registry.data[ns].features


def test_namespace_api_that_cannot_be_built():
    class BrokenApi(Api):
        def __init__(self):
            raise RuntimeError("api init failed")

    with pytest.raises(RegistryError, match="API class 'BrokenApi'.*RuntimeError: api init failed"):
        Registry.register_namespace_api(namespace=unique("ns"))(BrokenApi)


def test_abstract_namespace_api_is_reported_by_name():
    class Incomplete(BaseNamespaceAPI):  # the four hooks are missing
        pass

    with pytest.raises(RegistryError, match="API class 'Incomplete'.*abstract"):
        Registry.register_namespace_api(namespace=unique("ns"))(Incomplete)


def test_reset_clears_everything():
    Registry.register_namespace_api(namespace=unique("ns"))(make_api())
    Registry.reset()
    assert Registry.data == {}


# --------------------------------------------------------------------------------------------
# registration tags and add_tagged (how the loader rebuilds the registry after end_debug)
# --------------------------------------------------------------------------------------------


def test_registration_tags_are_own_and_not_inherited():
    ns = unique("ns")
    parent = Registry.register_feature(namespace=ns)(make_feature("Parent", "probe"))
    child = make_feature("Child", "probe", base=parent)
    assert registrations_of(parent) == (("feature", ns),)
    assert registrations_of(child) == ()
    assert registrations_of(make_api()) == ()


def test_add_tagged_rebuilds_a_cleared_registry():
    ns = unique("ns")
    api_cls = Registry.register_namespace_api(namespace=ns)(make_api())
    feature = Registry.register_feature(namespace=ns)(make_feature("Feat", "probe"))
    Registry.reset()
    Registry.add_tagged([feature, api_cls])  # order does not matter: APIs go first
    Registry.validate_and_init()
    assert type(Registry.data[ns].api) is api_cls
    assert type(Registry.data[ns].features["Feat"]) is feature


def test_class_registered_in_two_namespaces_is_rebuilt_in_both():
    ns_a, ns_b = unique("ns"), unique("ns")
    api_cls = make_api()
    Registry.register_namespace_api(namespace=ns_a)(api_cls)
    Registry.register_namespace_api(namespace=ns_b)(api_cls)
    feature = Registry.register_feature(namespace=ns_a)(Registry.register_feature(namespace=ns_b)(make_feature("Feat", "p")))
    assert set(registrations_of(feature)) == {("feature", ns_a), ("feature", ns_b)}
    assert registrations_of(api_cls) == (("namespace_api", ns_a), ("namespace_api", ns_b))
    Registry.reset()
    Registry.add_tagged([api_cls, feature])
    Registry.validate_and_init()
    for ns in (ns_a, ns_b):
        assert type(Registry.data[ns].features["Feat"]) is feature


def test_add_tagged_keeps_the_first_of_two_classes_with_one_name_and_warns_once():
    ns = unique("ns")
    Registry.register_namespace_api(namespace=ns)(make_api())
    one = Registry.register_feature(namespace=ns)(make_feature("Dup", "probe"))
    two = Registry.register_feature(namespace=ns)(make_feature("Dup", "probe"))
    three = Registry.register_feature(namespace=ns)(make_feature("Other", "probe"))
    four = Registry.register_feature(namespace=ns)(make_feature("Other", "probe"))
    with pytest.warns(RegistrationWarning) as record:
        Registry.add_tagged([one, two, three, four])
    assert len(record) == 1  # one warning for every registration left out
    message = str(record[0].message)
    assert "feature 'Dup'" in message and "feature 'Other'" in message and f"namespace '{ns}'" in message
    assert __file__ in message  # both definitions are located
    assert type(Registry.data[ns].features["Dup"]) is one
    assert type(Registry.data[ns].features["Other"]) is three


def test_feature_dirs_feature_replaces_a_default_one_of_its_name():
    ns = unique("ns")
    api_cls = Registry.register_namespace_api(namespace=ns)(make_api())
    default = Registry.register_feature(namespace=ns)(make_feature("Feat", "probe"))
    mine = Registry.register_feature(namespace=ns)(make_feature("Feat", "probe"))
    kept = Registry.register_feature(namespace=ns)(make_feature("Other", "probe"))
    with pytest.warns(RegistrationWarning, match="feature 'Feat' of namespace .* from feature_dirs replaces"):
        Registry.add_tagged(LoadedClasses([api_cls, default, kept, mine], from_user=[mine]))
    assert type(Registry.data[ns].api) is api_cls  # no API of its own: the default one stays
    assert {name: type(f) for name, f in Registry.data[ns].features.items()} == {"Feat": mine, "Other": kept}


def test_feature_dirs_api_takes_the_whole_namespace():
    ns = unique("ns")
    default_api = Registry.register_namespace_api(namespace=ns)(make_api())
    default_only = Registry.register_feature(namespace=ns)(make_feature("DefaultOnly", "probe"))  # registered on import
    script = Registry.register_feature(namespace=ns)(make_feature("FromScript", "probe"))  # loaded from no directory
    user_api, other_user_api = make_api(), make_api()
    other_user_api.__name__ = other_user_api.__qualname__ = "SecondApi"
    Registry.register_namespace_api(namespace=ns)(user_api)
    Registry.register_namespace_api(namespace=ns)(other_user_api)
    user_feature = Registry.register_feature(namespace=ns)(make_feature("UserFeat", "probe"))
    loaded = LoadedClasses(
        [default_api, default_only, user_api, other_user_api, user_feature], [user_api, other_user_api, user_feature]
    )
    with pytest.warns(RegistrationWarning) as record:
        Registry.add_tagged(loaded)
    message = str(record[0].message)
    assert len(record) == 1 and "comes from feature_dirs" in message and "DefaultOnly" in message
    assert "the API of namespace" in message and "SecondApi ignored" in message  # one API a namespace: the first
    assert type(Registry.data[ns].api) is user_api
    assert {type(f) for f in Registry.data[ns].features.values()} == {user_feature, script}


def test_add_tagged_allows_one_name_in_different_namespaces():
    ns_a, ns_b = unique("ns"), unique("ns")
    Registry.register_namespace_api(namespace=ns_a)(make_api())
    Registry.register_namespace_api(namespace=ns_b)(make_api())
    one = Registry.register_feature(namespace=ns_a)(make_feature("Same", "probe"))
    two = Registry.register_feature(namespace=ns_b)(make_feature("Same", "probe"))
    Registry.add_tagged([one, two, one])
    assert type(Registry.data[ns_a].features["Same"]) is one
    assert type(Registry.data[ns_b].features["Same"]) is two


def test_add_tagged_replaces_a_stale_registration():
    ns = unique("ns")
    Registry.register_namespace_api(namespace=ns)(make_api())
    stale = Registry.register_feature(namespace=ns)(make_feature("Feat", "old_api"))
    fresh = Registry.register_feature(namespace=ns)(make_feature("Feat", "new_api"))  # skipped: name taken
    assert type(Registry.data[ns].features["Feat"]) is stale
    with pytest.warns(RegistrationWarning, match="replaces .*Feat, registered on import"):
        Registry.add_tagged([fresh])
    assert type(Registry.data[ns].features["Feat"]) is fresh
    assert Registry.data[ns].feat_api_to_features["new_api"] == ["Feat"]
    assert Registry.data[ns].feat_api_to_features.get("old_api", []) == []


# --------------------------------------------------------------------------------------------
# end to end through initialize
# --------------------------------------------------------------------------------------------


def test_custom_namespace_end_to_end(tmp_path, log_dir):
    ns = write_namespace(tmp_path / "features")
    config = {"sec": {"enabled": True, "layers": {"layer_numbers": [1]}, ns.name: {"FeatB": {"enabled": True, "value": 7}}}}
    debug_api.initialize(config_file=config, feature_dirs=[ns.directory], log_dir=log_dir)
    assert {"base.LogTensorStats", f"{ns.name}.FeatA", f"{ns.name}.FeatB"} <= set(debug_api.list_features())
    namespace_api = getattr(debug_api, ns.name)
    assert namespace_api.name == ns.name
    assert namespace_api.probe("model.1.fc1") == ("FeatB", "model.1.fc1", 7)
    assert namespace_api.probe("model.2.fc1") == {}  # no feature configured, no default


def test_namespace_api_not_deriving_from_base_fails_initialize(tmp_path, log_dir):
    ns = write_namespace(tmp_path / "features", api_base="object")
    with pytest.raises(RegistryError, match=f"namespace '{ns.name}'.*must inherit from BaseNamespaceAPI"):
        debug_api.initialize(feature_dirs=ns.directory, log_dir=log_dir)
    assert debug_api.DEBUG_MANAGER is None
    assert Registry.data == {}


def test_features_without_namespace_api_fail_initialize(tmp_path, log_dir):
    ns = write_namespace(tmp_path / "features", ("Orphan",), with_api=False)
    with pytest.raises(RegistryError, match=rf"\['Orphan'\].*namespace '{ns.name}'"):
        debug_api.initialize(feature_dirs=ns.directory, log_dir=log_dir)
    assert debug_api.DEBUG_MANAGER is None
